"""The deterministic forward pass (kvdb.model.integer_lm): its functions against libm, batched against
one-token steps, the same bits in other processes (instruction set, threads, matmul settings),
and a golden digest of the embedded model's logits that must never change."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import REPO, SQRT_PROBE_AS_GOLDEN, sqrt_probe

from kvdb.errors import UnsupportedModel
from kvdb.model import integer_kernel
from kvdb.model import integer_lm as I
from kvdb.model import loading as M
from kvdb.model import tokenizer as tok

# sha256 of the embedded model's integer logits (float64, little-endian) over GOLDEN_TEXT's
# tokens, computed when the forward pass was specified (payload version 3, decision 0026). It
# changes only if the specification does, and then payloads written under the old one would no
# longer decode. GOLDEN_DIGEST_V2 is version 2's (torch.sqrt in the norms, decision 0025).
GOLDEN_TEXT = "The lighthouse keeper wrote: 'Storm at dusk; lamp lit at 18:40, ships safe.' Ünïcode → ok.\n"
GOLDEN_DIGEST = "fa64a05fa5b4f107f163b9d57083450a21ad392b84554e1fc3db365e0838bd23"
GOLDEN_DIGEST_V2 = "794e2885525262ef4eee6038ec0d673eca33353d14f85bd451f76c7281fbbefb"


def digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.numpy().astype("<f8").tobytes()).hexdigest()


def test_exp_cos_and_sin_are_close_to_libm_without_it():
    d = torch.linspace(-80, 0, 200_001, dtype=torch.float64)
    relative = ((I.exp_nonpositive(d) - torch.exp(d)) / torch.exp(d)).abs().max().item()
    assert relative < 1e-10
    floor, one = I.exp_nonpositive(torch.tensor([-1e9, 0.0], dtype=torch.float64)).tolist()
    assert one == 1.0 and abs(floor / math.exp(-80) - 1) < 1e-10  # clamped: no subnormals
    x = np.linspace(0, 2**17, 400_001)
    cos, sin = I.cos_sin(x)
    assert np.abs(cos - np.cos(x)).max() < 1e-10 and np.abs(sin - np.sin(x)).max() < 1e-10
    assert abs(I.inverse_frequencies(100000.0, 64)[1] - 100000.0 ** (-2 / 64)) < 1e-16


def test_a_linear_layer_is_its_integer_equation():
    """y = (sum_k round(x/s) q_k) * s * s_w, the activation row split into bytes, summed exactly."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1500, 7, bias=True)  # over KCHUNK inputs: summed in slices
    lin = I.Linear.of(layer)
    x = torch.randn(5, 1500, dtype=torch.float64) * 3
    q, s = I.quantize_rows(x)
    w = lin.weight.to(torch.float64).t()
    assert lin.weight.dtype == torch.int8 and w.abs().max() <= I.WEIGHT_LIMIT
    want = ((q @ w) * s) * lin.scale + lin.bias  # float64: exact, every sum below 2**53
    assert torch.equal(lin(x), want)
    np.testing.assert_allclose(lin(x).numpy(), layer(x.float()).detach().double().numpy(), rtol=0.05, atol=0.05)


@pytest.fixture
def tiny(tiny_loaded):
    """The session's loaded tiny model (and the integer passes lmcode builds of it once)."""
    return tiny_loaded


def _texts() -> list[str]:
    """Prose, code, a chat transcript and unicode: nobody's fixed values, only agreement is checked."""
    rng = np.random.default_rng(0)
    prose = (REPO / "kvdb" / "data" / "calibration.txt").read_text()
    code = (REPO / "kvdb" / "model" / "integer_lm.py").read_text()
    chat = "".join(
        f"<|im_start|>{role}\n{line}<|im_end|>\n"
        for role, line in zip(("user", "assistant") * 20, prose.splitlines()[:40])
    )
    unicode = "".join(chr(c) for c in rng.integers(0x20, 0x2FFF, size=3000) if not 0xD800 <= c < 0xE000)
    return [prose[:7000], code[:5000], chat, unicode]


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """A one-layer model: every operation of the pass, at half the cost of a step."""
    from support import make_tiny_model

    return M.load(str(make_tiny_model(tmp_path_factory.mktemp("one-layer"), num_hidden_layers=1)))


def test_the_kernel_is_built_and_its_square_root_is_correctly_rounded():
    """make install builds kvdb/model/integer_kernel.c; without it every test below would compare the
    reference pass with itself. torch.sqrt is not the specification's root (I.sqrt's docstring)."""
    assert integer_kernel.available(), integer_kernel.ISA
    x = torch.rand(50_000, dtype=torch.float64) * 1e3
    assert I.sqrt(x).tolist() == [math.sqrt(v) for v in x.tolist()]  # C's sqrt: IEEE 754 requires it correctly rounded


@pytest.mark.slow
def test_batched_chunks_give_the_one_token_steps_bits(one_layer):
    """The encoder may cut a sequence into any chunks; the decoder steps one token at a time.
    The kernel's chunks, the kernel's steps and the reference pass in one batch: one result, on
    the first 1,500 positions of each text (20,000 positions, all of them, under KVDB_TESTS=thorough)."""
    thorough = os.environ.get("KVDB_TESTS") == "thorough"
    ilm, reference = I.IntegerLM(one_layer.model), I.IntegerLM(one_layer.model, kernel=False)
    assert ilm.kernel is not None
    rng = np.random.default_rng(1)
    checked = 0
    for text in _texts():
        ids = np.asarray(tok.encode(one_layer.tokenizer, text), dtype=np.int64)
        for start in range(0, len(ids) - 64, 1500)[: None if thorough else 1]:  # sequences of up to 1,500 positions
            seq = ids[start : start + 1500]
            cuts = np.unique(np.concatenate([[0, len(seq)], rng.integers(1, len(seq), size=len(seq) // 150)]))
            batched = ilm.new_cache()
            chunks = torch.cat([ilm.forward(seq[a:b], batched) for a, b in zip(cuts[:-1], cuts[1:])])
            stepped = ilm.new_cache()
            steps = torch.cat([ilm.forward(seq[i : i + 1], stepped) for i in range(len(seq))])
            whole = reference.forward(seq, reference.new_cache())
            assert torch.equal(chunks, steps) and torch.equal(steps, whole), f"text {text[:20]!r}, positions {start}.."
            checked += len(seq)
    assert checked >= (20_000 if thorough else 6_000)


def test_the_reference_steps_give_the_kernels_bits(one_layer):
    """The reference pass one token at a time (its cache written and read by rows) against the kernel."""
    ilm, reference = I.IntegerLM(one_layer.model), I.IntegerLM(one_layer.model, kernel=False)
    ids = np.asarray(tok.encode(one_layer.tokenizer, _texts()[1][:600]), dtype=np.int64)[:150]
    cache, kernel_cache = reference.new_cache(), ilm.new_cache()
    steps = torch.cat([reference.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    assert torch.equal(steps, ilm.forward(ids, kernel_cache))
    for name in ("k", "v", "ks", "vs"):
        assert torch.equal(getattr(cache, name)[:, :, : len(ids)], getattr(kernel_cache, name)[:, :, : len(ids)])


_SCRIPT = """
import hashlib, json, sys, numpy as np, torch
from kvdb.model import integer_lm, loading as model
given = json.loads(sys.argv[1])
lm = model.load(given["model"])
ids = np.asarray(given["ids"], dtype=np.int64)
passes = {}
for settings in given["runs"]:  # each run under the settings before it too
    kernel = settings.get("kernel", True)
    ilm = passes.get(kernel) or passes.setdefault(kernel, integer_lm.IntegerLM(lm.model, kernel=kernel))
    assert (ilm.kernel is not None) == kernel
    torch.set_num_threads(settings.get("threads", 1))
    if settings.get("no_mkldnn"):
        torch.backends.mkldnn.enabled = False
    if settings.get("precision"):
        torch.set_float32_matmul_precision(settings["precision"])
    cache = ilm.new_cache()
    logits = torch.cat([ilm.forward(ids[:7], cache), ilm.forward(ids[7:], cache)])
    print(hashlib.sha256(logits.numpy().astype("<f8").tobytes()).hexdigest())
"""


def _digests_elsewhere(
    model: str | None, ids: np.ndarray, runs: list[dict], capability: str | None = None, simd: bool = True
) -> list[str]:
    """The logits' digest in a fresh process, once per entry of ``runs`` (the kernel or, with
    ``"kernel": False``, the reference pass; thread count, oneDNN off, float32 matmul
    precision), under ``ATEN_CPU_CAPABILITY=capability`` if given, the kernel with its plain C
    dot products unless ``simd``. One process serves several runs: each costs a model load."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("KVDB_INTEGER_SIMD", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    if not simd:
        env["KVDB_INTEGER_SIMD"] = "0"
    args = json.dumps({"model": model, "ids": ids.tolist(), "runs": runs})
    done = subprocess.run([sys.executable, "-c", _SCRIPT, args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.slow
def test_other_processes_compute_the_same_bits(tiny, tiny_model):
    """The reference pass under torch's plain C++ kernels (ATEN_CPU_CAPABILITY=default) and this
    CPU's best, 1 and 2 threads, oneDNN off, float32 matmuls allowed lower precision; the kernel
    with its AVX2 and its plain C dot products, 1 and 2 threads: one digest."""
    ids = np.asarray(tok.encode(tiny.tokenizer, "Portable: the same bits on any CPU. " * 8), dtype=np.int64)
    ilm = I.IntegerLM(tiny.model)
    here = digest(ilm.forward(ids, ilm.new_cache()))
    reference = [{"threads": 1, "kernel": False}, {"threads": 2, "kernel": False}]
    kernel = [{"threads": 2}, {"threads": 1}]
    plain = _digests_elsewhere(
        tiny_model, ids, kernel + reference, capability="default", simd=False
    )  # no SIMD anywhere
    best = _digests_elsewhere(
        tiny_model,
        ids,
        [*kernel, reference[1], {"threads": 1, "kernel": False, "no_mkldnn": True, "precision": "medium"}],
    )
    assert plain + best == [here] * 8


@pytest.mark.model
def test_the_embedded_models_logits_match_the_golden_digest_on_any_instruction_set(embedded):
    """Version 3's digest everywhere, in this process and under other instruction sets and thread
    counts. Version 2's only where torch.sqrt gives the roots it gave where that digest was taken
    (tests/support.py's probe): elsewhere (an Intel Xeon with AVX-512, for one) torch's vector
    math library rounds differently, which is why version 3 exists."""
    ids = np.asarray(tok.encode(embedded.tokenizer, GOLDEN_TEXT), dtype=np.int64)
    ilm = I.IntegerLM(embedded.model)
    logits = ilm.forward(ids, ilm.new_cache())
    assert digest(logits) == GOLDEN_DIGEST
    if sqrt_probe()[0] == SQRT_PROBE_AS_GOLDEN:  # version 2's premise: torch.sqrt rounds as where its digest was taken
        assert digest(ilm.with_torch_sqrt().forward(ids, ilm.new_cache())) == GOLDEN_DIGEST_V2
    assert (
        _digests_elsewhere(
            None, ids, [{"threads": 2, "kernel": False}, {"threads": 1}], capability="default", simd=False
        )
        == [GOLDEN_DIGEST] * 2
    )
    with torch.no_grad():
        exact = embedded.model(torch.as_tensor(ids)[None]).logits[0].double()
    nll = (  # noqa: E731
        lambda lg: -torch.log_softmax(lg, -1)[:-1].gather(1, torch.as_tensor(ids[1:])[:, None]).mean().item()
    )
    assert nll(logits) < 1.02 * nll(exact)  # close to the float model (benchmarks/lmcode.py measures it at length)


def test_models_it_does_not_cover_are_refused_with_the_reason():
    gpt2 = SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))
    assert "Llama-family" in I.IntegerLM.unsupported(gpt2)
    llama3 = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
    scaled = SimpleNamespace(config=llama3, model=SimpleNamespace(layers=[]), lm_head=None)
    with pytest.raises(UnsupportedModel, match="llama3"):
        I.IntegerLM(scaled)

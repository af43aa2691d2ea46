"""A request that names no temperature or top_p samples as the model's generation config says
(the embedded SmolLM2-Instruct: 0.2 and 0.9), on both completion routes (the page's chats are
the first): not at the OpenAI API's 1.0, at which a small instruct model writes gibberish."""

from __future__ import annotations

from kvdb.model.source import EMBEDDED_SAMPLING
from kvdb.serving import Sampling
from kvdb.serving.generation import model_sampling

ONE = [{"role": "user", "content": "Tell me about the harbour."}]


def test_the_defaults_are_the_generation_configs(tiny_loaded, monkeypatch):
    config = tiny_loaded.model.generation_config
    assert model_sampling(tiny_loaded) == Sampling(temperature=1.0, top_p=1.0)  # it names none: the OpenAI API's
    monkeypatch.setattr(config, "temperature", EMBEDDED_SAMPLING["temperature"])
    monkeypatch.setattr(config, "top_p", EMBEDDED_SAMPLING["top_p"])
    assert model_sampling(tiny_loaded) == Sampling(temperature=0.2, top_p=0.9)
    monkeypatch.setattr(config, "do_sample", False)
    assert model_sampling(tiny_loaded).temperature == 0
    assert Sampling(top_p=0.5).defaulted(model_sampling(tiny_loaded)) == Sampling(temperature=0, top_p=0.5)


def test_a_request_that_omits_temperature_takes_the_models_on_each_route(serve, tiny_loaded, monkeypatch):
    monkeypatch.setattr(tiny_loaded.model.generation_config, "do_sample", False)  # the model's own: greedy
    running = serve()
    routes = [("/v1/chat/completions", {"messages": ONE}), ("/v1/completions", {"prompt": "The harbour master"})]
    with running.http() as client:

        def replies(path: str, body: dict, **sampling) -> set[str]:
            answers = [
                client.post(path, json={"model": "kvdb", "max_tokens": 8, "seed": seed, **body, **sampling}).json()
                for seed in range(4)
            ]
            return {
                a["choices"][0]["message"]["content"] if "message" in a["choices"][0] else a["choices"][0]["text"]
                for a in answers
            }

        for path, body in routes:
            greedy = replies(path, body, temperature=0)
            assert replies(path, body) == greedy and len(greedy) == 1, path
            assert len(replies(path, body, temperature=1)) > 1, path  # sampled, the seeds would tell

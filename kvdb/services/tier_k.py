"""Tier K: the KV cache quantized with the codebooks of a preset (residual VQ, kvdb.codecs.quant; or
transform coded, kvdb.codecs.transform and kvdb.codecs.entropy_coded), keys rotated back to
pre-RoPE. This service finds the codebooks of a preset (trained on the archive's own
sessions, else the shipped ones of kvdb.services.shipped_codebooks), trains them on request, codes
a cache at ingest, de-quantizes a path's positions for a restore, and says what the path's preset
was measured to cost (kvdb.codecs.fidelity); it keeps the codebooks it has parsed
(content-addressed by id, so never stale)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import numpy as np
import torch

from kvdb.codecs import code_layout, entropy_coded, fidelity, presets, quant, transform
from kvdb.codecs.code_layout import KVCodebooks
from kvdb.errors import InvalidArgument
from kvdb.model import capture
from kvdb.records import CodebookSource, PresetFidelity, ShippedCodebooks, TrainedCodebooks
from kvdb.services import shipped_codebooks as shipped
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.storage import Storage
from kvdb.storage.base import CodebookRow, NodeRow, PutCodebooks, SessionRow


class TierK:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._books: dict[str, KVCodebooks] = {}
        self._decoding: dict[str, KVCodebooks] = {}  # codebook id -> sharpened for restores
        # codebook id -> the shipped codebooks' reference, as the archive stores it
        self._references: dict[str, bytes] = {}

    def codebooks(
        self, model_id: str, codebook_id: str | None = None, preset: str = presets.DEFAULT_NAME
    ) -> tuple[str, KVCodebooks]:
        """The named codebooks, else the model's newest of ``preset`` (a name or a spec), else the
        shipped ones of that spec (kvdb.services.shipped_codebooks: built on this machine's first
        use; ``ensure_codebooks`` references them in the archive)."""
        if codebook_id is None:
            spec = self._spec(model_id, preset)
            found = self._storage.codebooks_for(model_id, spec)
            if found is None:
                return self._shipped(model_id, spec)
            codebook_id = found[0]
        if codebook_id not in self._books:
            data = self._storage.codebook_data(codebook_id)
            self._books[codebook_id] = (
                self._referenced(model_id, data) if shipped.is_reference(data) else code_layout.read_codebooks(data)
            )
        return codebook_id, self._books[codebook_id]

    def build_shipped(self, progress=None, preset: str = presets.DEFAULT_NAME) -> ShippedCodebooks:
        """This machine's shipped codebooks of a preset for the archive's model, built if missing
        (the archive records a reference only once a session is coded with them)."""
        start = time.perf_counter()
        loaded = self._models.get()
        spec = presets.resolve(preset, loaded.identity.weights_hash)
        self._storage.before_compute()  # a first build takes minutes: nobody waits on the file meanwhile
        reference, books, built = shipped.build(loaded, progress, preset=spec)
        return ShippedCodebooks(
            loaded.identity.model_id,
            books.preset,
            reference.nbytes,
            built,
            str(shipped.cache_path(reference.key)),
            round(time.perf_counter() - start, 2),
        )

    def ensure_codebooks(self, model_id: str, preset: str = presets.DEFAULT_NAME) -> str:
        """The id of the codebooks new sessions of a preset (a name or a spec) are coded with: the
        model's newest of that spec, else the shipped ones, whose reference is written to the
        archive here (their first build on this machine takes minutes, with the file let go).
        Sessions coded before keep the codebooks they were coded with."""
        # parsed now, with the file held: coding later reads nothing from it
        codebook_id, books = self.codebooks(model_id, preset=preset)
        if self._storage.codebooks_for(model_id, books.preset) is None:
            reference = self._references[codebook_id]
            self._storage.apply(PutCodebooks(codebook_id, model_id, books.preset, reference))
        return codebook_id

    def path_fidelity(self, nodes: list[NodeRow]) -> PresetFidelity:
        """What a restore from these nodes' tier K was measured to cost (kvdb.codecs.fidelity): the
        least faithful of the codebook sets they were coded with (one, unless the path's nodes were
        ingested with different presets); codebooks trained on the archive are never measured."""
        used = set(self._storage.node_codebooks([n.node_id for n in nodes]).values())
        found = [self._fidelity(row) for row in self._storage.codebook_rows() if row.codebook_id in used]
        assert found, "a node with tier K names codebooks the archive holds"
        return max(found, key=_loss)

    def _fidelity(self, row: CodebookRow) -> PresetFidelity:
        source = shipped.codebook_set(row).source
        model = self._storage.get_model(row.model_id)
        assert model is not None  # the model of stored codebooks is stored
        # a benchmark's trained codebooks are not this archive's: only shipped figures describe its restores
        figures = (
            fidelity.measured(model.weights_hash, row.preset, source.value)
            if source is CodebookSource.SHIPPED
            else None
        )
        name = presets.name_of(row.preset, model.weights_hash)
        if figures is None:
            return PresetFidelity(name, row.preset, source)
        return PresetFidelity(name, row.preset, source, figures["lengths"], figures.get("measured_by"))

    def _spec(self, model_id: str, preset: str) -> str:
        row = self._storage.get_model(model_id)
        weights_hash = row.weights_hash if row is not None else self._loaded(model_id).identity.weights_hash
        return presets.resolve(preset, weights_hash)

    def _shipped(self, model_id: str, spec: str) -> tuple[str, KVCodebooks]:
        loaded = self._loaded(model_id)
        self._storage.before_compute()  # a first build takes minutes: nobody waits on the file meanwhile
        reference, books, _ = shipped.build(loaded, preset=spec)
        data = reference.to_bytes()
        codebook_id = hashlib.sha256(data).hexdigest()[:32]
        self._books[codebook_id] = books
        self._references[codebook_id] = data
        return codebook_id, books

    def _referenced(self, model_id: str, data: bytes) -> KVCodebooks:
        """The shipped codebooks an archive references: this machine's build, made if missing."""
        reference = shipped.Reference.from_bytes(data)
        books = shipped.cached(reference)
        if books is None:
            loaded = self._loaded(model_id)
            if not shipped.buildable(reference.recipe, loaded.identity):
                raise InvalidArgument(
                    f"this archive's tier K uses shipped codebooks this kvdb cannot build (recipe {reference.recipe}); "
                    f"restore with --mode exact, or open it with the kvdb version that wrote it"
                )
            self._storage.before_compute()
            _, books, _ = shipped.build(loaded, wanted=reference.recipe)
        return books

    def _restoring(self, model_id: str, codebook_id: str) -> KVCodebooks:
        """The codebooks a restore decodes with: the stored ones, keys sharpened by the model's
        measured factor (``presets.key_sharpening``). Search and coding use the stored ones."""
        if codebook_id not in self._decoding:
            _, books = self.codebooks(model_id, codebook_id)
            row = self._storage.get_model(model_id)
            assert row is not None  # the model of stored codebooks is stored
            self._decoding[codebook_id] = books.sharpened(presets.key_sharpening(row.weights_hash))
        return self._decoding[codebook_id]

    def _loaded(self, model_id: str):
        loaded = self._models.get()
        if loaded.identity.model_id != model_id:
            raise InvalidArgument(
                f"tier K of model {model_id[:12]} needs that model; this archive is open with {loaded.identity.name}"
            )
        return loaded

    def codes(
        self, loaded, cache, start: int, end: int | None = None, codebook_id: str | None = None
    ) -> tuple[str, dict[int, np.ndarray]]:
        """Tier K of positions [start, end) from the ingest pass's own cache, as token-major code
        streams, with the codebooks named (looked up before the file was let go: coding then reads
        nothing from it), else the model's newest."""
        codebook_id, books = self.codebooks(loaded.identity.model_id, codebook_id)
        keys, values = capture.cache_arrays(cache, start, end)
        if books.pre_rope:
            capture.rotator(loaded.model, start, keys.shape[2], inverse=True)(torch.from_numpy(keys))
        return codebook_id, code_layout.code_streams(books, code_layout.encode(books, keys, values))

    def cut(self, node: NodeRow, offset: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The entropy-coded payloads of a node's halves before and from ``offset``, coded again (a
        payload cannot be cut as token-major streams are, which storage cuts itself), or None
        when the node's tier K is in streams."""
        stored = self._storage.node_kv(node.node_id)
        if stored is None or entropy_coded.PAYLOAD not in stored[1]:
            return None
        _, books = self.codebooks(node.model_id, stored[0])
        keys, values = code_layout.codes_from_streams(books, stored[1], node.n_tokens)
        head = code_layout.code_streams(books, (keys[..., :offset], values[..., :offset]))
        tail = code_layout.code_streams(books, (keys, values), start=offset)
        return head[entropy_coded.PAYLOAD], tail[entropy_coded.PAYLOAD]

    def train(self, preset: str | None = None, tokens: int = 8192, niter: int = 12) -> TrainedCodebooks:
        """Codebooks for the archive's model, trained on its own archived sessions (oldest first,
        up to ``tokens`` positions; attention sinks left out: they are recomputed), of a preset (a
        name or a spec; default: balanced, as ingest's)."""
        loaded = self._models.get()
        preset = presets.resolve(preset or presets.DEFAULT_NAME, loaded.identity.weights_hash)
        needed = self._positions_needed(loaded, preset)
        start = time.perf_counter()
        keys, values, contexts, used = [], [], [], 0
        for row in self._storage.list_sessions():
            if row.model_id != loaded.identity.model_id or used >= tokens:
                continue
            ids = self._reader.path_tokens(row, 0, min(row.n_tokens, tokens - used + capture.SINKS))
            k, v = capture.capture(loaded.model, ids, pre_rope=True)
            keys.append(k[:, :, capture.SINKS :])
            values.append(v[:, :, capture.SINKS :])
            contexts.append(ids)
            used += k.shape[2] - capture.SINKS
        if used < needed:  # too few under the --tokens cap, or in the archive
            advice = (
                f"pass --tokens {needed} or more"
                if tokens < needed
                else "archive more sessions first, then run `kvdb codebooks train` again"
            )
            raise InvalidArgument(
                f"training {preset} codebooks needs at least {needed} archived positions (attention sinks left out), "
                f"and {used} were read; {advice}"
            )
        fisher = (
            dict(zip(quant.KINDS, capture.cache_fisher(loaded.model, contexts)))
            if transform.is_transform_preset(preset)
            else None
        )
        books = code_layout.train(
            {"k": np.concatenate(keys, axis=2), "v": np.concatenate(values, axis=2)},
            preset,
            fisher,
            niter=niter,
            meta={"model_id": loaded.identity.model_id, "tokens": used},
        )
        data = books.to_bytes()
        codebook_id = hashlib.sha256(data).hexdigest()[:32]
        self._models.register()
        self._storage.apply(PutCodebooks(codebook_id, loaded.identity.model_id, preset, data))
        return TrainedCodebooks(codebook_id, preset, used, len(data), round(time.perf_counter() - start, 2))

    @staticmethod
    def _positions_needed(loaded, preset: str) -> int:
        """The calibration positions a preset's training needs: a transform coder's finest quantizer
        has 2**8 levels; a residual VQ's largest codebook as many centroids. Refuses a VQ preset
        that gives some head no stages (it would restore as zeros)."""
        if transform.is_transform_preset(preset):
            return 1 << transform.MAX_BITS
        layers, _, heads, _ = capture.attention_shape(loaded.model)
        depth = presets.depths(preset, layers, heads)
        bare = [f"{kind}@{layer}.{head}" for kind, d in depth.items() for layer, head in np.argwhere(d == 0)]
        if bare:
            raise InvalidArgument(
                f"preset {preset!r} gives {', '.join(bare[:4])}{' ...' if len(bare) > 4 else ''} no stages; "
                "every head needs at least one of keys and of values"
            )
        return max(
            size for kind in presets.allocation(preset, layers, heads).values() for stage in kind for size in stage
        )

    def layers(self, row: SessionRow, nodes: list[NodeRow], at: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """De-quantized pre-RoPE keys and values of positions [0, at), layer by layer
        (``code_layout.decode_streams``): every node's codes are read here, and decoded as the caller
        takes each layer, so the caller may let the file go first."""
        parts = []
        for node in nodes:
            stored = self._storage.node_kv(node.node_id)
            if stored is None:
                raise InvalidArgument(
                    f"session {row.session_id[:12]} ({row.name}) has no tier K on all of its first {at} tokens; "
                    f"ingest it with --keep tokens,search,kv, or restore with --mode exact"
                )
            used = min(node.n_tokens, at - node.start)  # de-quantize only the positions restored
            parts.append(
                code_layout.decode_streams(self._restoring(node.model_id, stored[0]), stored[1], node.n_tokens, used)
            )
        if len(parts) == 1:  # one node (the common case): its layers as decoded, not joined
            return parts[0]
        return (
            (np.concatenate(ks, axis=1), np.concatenate(vs, axis=1))
            for ks, vs in (zip(*layer) for layer in zip(*parts))
        )


def _loss(measured: PresetFidelity) -> float:
    """A preset's worst measured perplexity ratio; unmeasured counts as the worst of all."""
    worst = fidelity.worst_ppl(measured.lengths)
    return float("inf") if worst is None else worst[1]

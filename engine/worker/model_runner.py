"""Executes one ``SchedulerOutput``: builds inputs, runs the model, samples.

Owns the KV cache: one preallocated tensor ``[num_blocks, slots, 2, block_size, kv_heads,
head_dim]`` (block-major, cross-layer: one block of every layer of a KV-cache group is one
span; ``slots`` is the layers per group, all layers when there is one group); the model sees
strided per-layer views and the attention metadata of its layer's group.
"""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import (
    MissingPixelsError,
    ModelRunnerOutput,
    SchedulerOutput,
)
from epdserve.engine.core.kv_cache_groups import KVCacheSpec, make_kv_cache_spec
from epdserve.engine.lora.batch import LoRABatch
from epdserve.engine.models.decoder import AttentionMetadata, DecoderLM
from epdserve.engine.sample.sampler import SamplingRow, argmax_rows, compute_logprobs, sample
from epdserve.engine.structured.mask import apply_bitmask
from epdserve.engine.worker.device_inputs import DeviceInputs
from epdserve.engine.worker.input_batch import InputBatch
from epdserve.engine.worker.mm_inputs import EncoderOutputs, place_image_embeddings
from epdserve.kernels import native


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        kv_connector=None,
        vision_encoder=None,
        ec_connector=None,
        spec: KVCacheSpec | None = None,
        lora=None,
        kv_dtype: torch.dtype | None = None,  # what the cache stores (None: the model's)
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        spec = spec or make_kv_cache_spec([None] * cfg.num_layers)
        self.kv_cache = torch.zeros(
            (num_blocks, spec.slots, 2, block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=kv_dtype or model.dtype,
            device=model.device,
        )
        placement = spec.layer_placement()
        self.layer_caches = [(self.kv_cache[:, j, 0], self.kv_cache[:, j, 1]) for _, j in placement]
        if self.kv_cache.device.type == "cpu":
            native.available()  # build the C decode kernel now, not on the first request
        self.layer_groups = [g for g, _ in placement]
        self.batch = InputBatch(
            max_num_reqs, max_model_len, block_size, len(spec.groups), model.device
        )
        self.device_inputs = DeviceInputs(model.device)  # pinned staging off the CPU
        self.kv_connector = kv_connector  # worker side of a KV connector, if any
        self.encoder_outputs = (
            EncoderOutputs(vision_encoder, ec_connector) if vision_encoder else None
        )
        self.mm_features: dict[str, list] = {}  # request -> its multimodal items
        self.lora = lora  # the worker's LoRASlots (its stacks and scaling), if LoRA is on
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_cache)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.batch.remove(req_id)
            self.mm_features.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.batch.add(
                new.req_id,
                new.token_ids,
                new.params,
                new.block_ids,
                new.num_computed_tokens,
                new.num_prompt_tokens,
                new.lora_slot,
            )
            if new.mm_features:
                self.mm_features[new.req_id] = new.mm_features
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.batch.states[req_id].row
            self.batch.append_blocks(row, block_ids)
            self.batch.num_computed[row] = computed

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        connector = self.kv_connector
        if connector is not None:
            connector.bind_connector_metadata(sched.kv_connector_metadata)
            connector.start_load_kv()
        out = self._forward(sched) if sched.num_scheduled_tokens else ModelRunnerOutput([], [])
        if connector is not None:
            connector.wait_for_save()
            out.kv_connector_output = connector.take_output(set(sched.finished_req_ids))
        return out

    @torch.inference_mode()
    def _forward(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        inputs = self.batch.prepare(sched.num_scheduled_tokens)  # host tensors
        dev = self.device_inputs.move(inputs)  # the same on the model's device
        metas = [
            AttentionMetadata(dev.positions, slots, table, dev.seq_lens, dev.query_start_loc)
            for slots, table in zip(dev.slot_mapping, dev.block_table, strict=True)
        ]
        if dev.lora_slots is not None:
            lora = LoRABatch(dev.lora_slots, self.lora.stacks, self.lora.scaling)
            for m in metas:
                m.lora = lora
        embeds = self._multimodal_embeds(sched, inputs, dev.input_ids, metas)
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.layer_groups]
        if embeds is None:
            hidden = self.model.forward(dev.input_ids, meta, self.layer_caches)
        else:
            hidden = self.model.forward(dev.input_ids, meta, self.layer_caches, embeds)
        sampled: dict[str, list[int]] = {}
        logprobs = {}
        if inputs.sample_req_ids:
            logits = self.model.compute_logits(hidden[dev.logits_indices])
            if logits is None:  # a rank that does not sample takes the output rank's tokens
                self._follow(inputs.sample_req_ids)
            else:
                sampled, logprobs = self._sample(logits, inputs.sample_req_ids, sched)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        return ModelRunnerOutput(
            inputs.order, [sampled.get(r, []) for r in inputs.order], logprobs, prompt_logprobs
        )

    def _multimodal_embeds(
        self, sched: SchedulerOutput, inputs, input_ids: torch.Tensor, metas
    ) -> torch.Tensor | None:
        """Encode this step's images; token embeddings with image features in place. Under
        tensor parallelism the output rank alone encodes (and loads, and stores) images, and
        the other ranks take its embeddings."""
        outputs, tp = self.encoder_outputs, self.model.tp
        if outputs is None and not (tp.size > 1 and self.model.config.multimodal):
            return None
        images = tp.size > 1 and bool(sched.scheduled_encoder_inputs or sched.encoder_loads)
        if outputs is not None:
            try:
                self._encode(sched, outputs)
            except Exception:
                if images:
                    _step_status(tp, input_ids.device, failed=True)
                raise
        if images:
            _step_status(tp, input_ids.device)  # the output rank's word on its images
        if not any(r in self.mm_features for r in inputs.order):
            return None
        embeds = self.model.embed_tokens(input_ids)
        counts = inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]
        starts = inputs.seq_lens - counts
        spans = place_image_embeddings(
            embeds,
            inputs.order,
            starts,
            counts,
            inputs.query_start_loc,
            lambda r: self.mm_features.get(r),
            outputs,  # None: the spans only
        )
        tp.broadcast(embeds)
        for meta in metas:
            meta.bidirectional_spans = spans
        return embeds

    def _encode(self, sched: SchedulerOutput, outputs) -> None:
        outputs.free(sched.free_encoder_ids)
        scheduled = [
            self.mm_features[r][i]
            for r, idxs in sched.scheduled_encoder_inputs.items()
            for i in idxs
        ]
        if sched.encoder_loads:
            loads = set(sched.encoder_loads)
            outputs.load(
                [f for f in scheduled if f.identifier in loads],
                self.model.config.hidden_size,
                self.model.dtype,
            )
        try:
            outputs.encode(scheduled)
        except MissingPixelsError as exc:  # those requests fail, not the step's others
            gone = set(exc.identifiers)
            exc.request_ids = [
                r
                for r, idxs in sched.scheduled_encoder_inputs.items()
                if any(self.mm_features[r][i].identifier in gone for i in idxs)
            ]
            raise

    def _sample(self, logits: torch.Tensor, req_ids: list[str], sched: SchedulerOutput):
        states = [self.batch.states[r] for r in req_ids]
        tokens = raw_logprobs = None
        try:
            tokens, raw_logprobs = self._choose(logits, req_ids, states, sched)
        finally:  # the other ranks wait for the tokens: -1s when sampling raised
            if self.model.tp.size > 1:
                sent = torch.full((len(req_ids),), -1, dtype=torch.int64, device=logits.device)
                tokens = self.model.tp.broadcast(sent if tokens is None else tokens.to(torch.int64))
        want_lp = [s.params.logprobs for s in states]
        batch_rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        token_np = tokens.cpu().numpy()  # the step's one host sync on a device
        self.batch.append_token(batch_rows, token_np)
        token_list = token_np.tolist()
        sampled = {r: [t] for r, t in zip(req_ids, token_list, strict=True)}
        logprobs = {}
        if raw_logprobs is not None:
            for i, (req_id, k) in enumerate(zip(req_ids, want_lp, strict=True)):
                if k is not None:
                    logprobs[req_id] = compute_logprobs(
                        raw_logprobs[i : i + 1], tokens[i : i + 1], k
                    )
        return sampled, logprobs

    def _choose(self, logits: torch.Tensor, req_ids, states, sched: SchedulerOutput):
        """The step's tokens, and the model's log-probabilities if a request wants them."""
        params = [s.params for s in states]
        all_greedy = all(p.greedy for p in params)
        want_lp = [p.logprobs for p in params]
        raw_logprobs = None
        if want_lp.count(None) != len(want_lp):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # of the model, before any bias
        if any(p.logit_bias for p in params):
            for i, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
                    bias = torch.tensor(
                        list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device
                    )
                    logits[i].index_add_(0, ids, bias)
        if sched.grammar_req_ids:  # structured outputs: only the grammar's tokens remain
            row = {r: i for i, r in enumerate(req_ids)}
            rows = [row[r] for r in sched.grammar_req_ids]
            apply_bitmask(logits, rows, sched.grammar_bitmask, len(rows))
        if all_greedy and not any(p.needs_penalties for p in params):
            tokens = argmax_rows(logits)  # no per-row sampling state to build
        else:
            tokens = sample(logits, [self._sampling_row(s) for s in states], all_greedy)
        return tokens, raw_logprobs

    def _follow(self, req_ids: list[str]) -> None:
        """Append the tokens the output rank sampled (tensor parallelism, other ranks)."""
        tokens = torch.empty(len(req_ids), dtype=torch.int64, device=self.model.device)
        token_np = self.model.tp.broadcast(tokens).cpu().numpy()
        if (token_np < 0).any():  # its sampling raised: this step fails on every rank
            raise RuntimeError("the output rank could not sample this step")
        rows = [self.batch.states[r].row for r in req_ids]
        self.batch.append_token(np.asarray(rows, dtype=np.int64), token_np)

    def _sampling_row(self, state) -> SamplingRow:
        row = SamplingRow(state.params, state.generator)
        if state.params.needs_penalties:
            n = int(self.batch.num_tokens[state.row])
            ids = self.batch.token_ids[state.row, :n].tolist()
            row.prompt_ids = ids[: state.num_prompt_tokens]
            row.output_ids = ids[state.num_prompt_tokens :]
        return row

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs) -> dict:
        out = {}
        for i, req_id in enumerate(inputs.order):
            state = self.batch.states[req_id]
            k = state.params.prompt_logprobs
            if k is None:
                continue
            start, end = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
            first_pos = int(inputs.positions[start])
            # position p predicts prompt token p+1; the last prompt token predicts nothing here
            last_pos = min(int(inputs.positions[end - 1]), state.num_prompt_tokens - 2)
            if last_pos < first_pos:
                continue
            n = last_pos - first_pos + 1
            logits = self.model.compute_logits(hidden[start : start + n])
            if logits is None:  # not the output rank: it joined the gather, that is all
                continue
            targets = torch.from_numpy(
                self.batch.token_ids[state.row, first_pos + 1 : last_pos + 2].copy()
            ).to(hidden.device)
            out[req_id] = compute_logprobs(torch.log_softmax(logits, -1), targets, k)
        return out


def _step_status(tp, device: torch.device, failed: bool = False) -> None:
    """The output rank tells the others whether this step's images are ready (a refused
    step raises on every rank at the same point, so the group stays in step)."""
    flag = tp.broadcast(torch.tensor([int(failed)], dtype=torch.int64, device=device))
    if flag.item() and not tp.is_output:
        raise MissingPixelsError([], [])

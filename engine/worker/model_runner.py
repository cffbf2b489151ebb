"""Executes one ``SchedulerOutput``: builds inputs, runs the model, samples.

Owns the KV cache: one preallocated tensor ``[num_blocks, slots, 2, block_size, kv_heads,
head_dim]`` (block-major, cross-layer: one block of every layer of a KV-cache group is one
span; ``slots`` is the layers per group, all layers when there is one group); the model sees
strided per-layer views and the attention metadata of its layer's group.
"""

from __future__ import annotations

import torch

from epdserve.engine.core.interfaces import (
    MissingPixelsError,
    ModelRunnerOutput,
    SchedulerOutput,
)
from epdserve.engine.core.kv_cache_groups import KVCacheSpec, make_kv_cache_spec
from epdserve.engine.lora.batch import LoRABatch
from epdserve.engine.models.decoder import AttentionMetadata, DecoderLM
from epdserve.engine.worker.device_inputs import DeviceInputs
from epdserve.engine.worker.input_batch import InputBatch
from epdserve.engine.worker.mm_inputs import EncoderOutputs, place_image_embeddings
from epdserve.engine.worker.step_sampler import StepSampler
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
        max_num_tokens: int | None = None,  # the largest step (None: max_model_len)
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
        self.device_inputs = DeviceInputs(  # off the CPU: one packed copy per step
            model.device,
            max_num_tokens or max(max_model_len, max_num_reqs),
            max_num_reqs,
            self.batch.block_table.shape[2],
            len(spec.groups),
        )
        self.sampler = StepSampler(model, self.batch)
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
            self.sampler.remove(req_id)  # before the batch frees the row
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
            self.sampler.add(new.req_id)  # the row's sampling parameters
            if new.mm_features:
                self.mm_features[new.req_id] = new.mm_features
        cached = sched.scheduled_cached_reqs
        if cached.req_ids:  # most steps: every request decodes, few take a new block
            batch = self.batch
            rows = list(map(batch.row_of.__getitem__, cached.req_ids))
            for k, block_ids in enumerate(cached.new_block_ids):
                if block_ids and block_ids[0]:  # every group grows by the same count
                    batch.append_blocks(rows[k], block_ids)
            batch.num_computed[rows] = cached.num_computed_tokens

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
        dev = self.device_inputs.move(inputs, self.batch.block_table)  # on the model's device
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
        order, sampling = inputs.order, inputs.sample_req_ids
        sampled, logprobs = None, {}
        if sampling:
            picked = hidden if inputs.every_token_samples else hidden[dev.logits_indices]
            logits = self.model.compute_logits(picked)
            if logits is None:  # a rank that does not sample takes the output rank's tokens
                self.sampler.follow(sampling)
            else:
                sampled, logprobs = self.sampler.sample(logits, sampling, sched, inputs.sample_rows)
        prompt_logprobs = self.sampler.prompt_logprobs(hidden, inputs)
        if sampled is None:
            token_ids = [[] for _ in order]
        elif sampling is order:  # every request sampled (decode steps)
            token_ids = sampled
        else:  # partial prefill chunks sample nothing
            by_id = dict(zip(sampling, sampled, strict=True))
            token_ids = [by_id.get(r, []) for r in order]
        return ModelRunnerOutput(order, token_ids, logprobs, prompt_logprobs)

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


def _step_status(tp, device: torch.device, failed: bool = False) -> None:
    """The output rank tells the others whether this step's images are ready (a refused
    step raises on every rank at the same point, so the group stays in step)."""
    flag = tp.broadcast(torch.tensor([int(failed)], dtype=torch.int64, device=device))
    if flag.item() and not tp.is_output:
        raise MissingPixelsError([], [])

"""The one input processor: render -> tokenize -> images -> ``ProcessedPrompt``.

The OpenAI server, the offline ``LLM`` and ``/tokenize`` all come through here; it is the
only place that knows chat templates and image processors. Errors are ``ValueError``s whose
message starts with the request part they name.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from epdserve.common.chat_parts import IMAGE_PART_TYPES, image_parts, template_messages
from epdserve.common.chat_template import ChatTemplate
from epdserve.common.prompt_signing import FIELD as SIGNATURE
from epdserve.common.prompt_signing import PromptSigner
from epdserve.engine.inputs.budget import check_request_pixels
from epdserve.engine.inputs.image_processor import ImageProcessor, check_processor_kwargs
from epdserve.engine.inputs.images import ImageLimits, LoadedImage, load_image_url_async
from epdserve.engine.inputs.prompt import ProcessedPrompt, PromptRules, from_wire
from epdserve.engine.tokenizer import TokenizerInfo


def is_multimodal(model_dir: str) -> bool:
    path = Path(model_dir) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


class InputProcessor:
    """Turns one model's requests into processed prompts."""

    def __init__(
        self,
        model_dir: str,
        model_id: str,
        tokenizer: TokenizerInfo | None = None,
        image_limits: ImageLimits | None = None,
        max_images: int = 8,
        processor_kwargs: dict | None = None,
    ):
        self.tok = tokenizer or TokenizerInfo(model_dir)
        self.template = ChatTemplate.from_dir(model_dir)
        self.model_id = model_id
        self.image_limits = image_limits or ImageLimits()
        self.max_images = max_images
        self.images: ImageProcessor | None = None
        if is_multimodal(model_dir):
            self.images = ImageProcessor(
                model_dir, model_id, self.tok, max_images, processor_kwargs
            )
        self.signer: PromptSigner | None = None  # the pool's key: wire prompts are signed
        images = self.images
        self.rules = PromptRules(
            self.tok.vocab_size,
            images.image_token_id if images else None,
            images.tokens_per_image if images else 0,
            max_images * (1 + images.max_crops) if images else 0,
        )

    # --- completions --------------------------------------------------------------------
    def completion(self, prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        """A text prompt (tokenized here) or token ids (checked against the vocabulary)."""
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt, add_special_tokens=add_special_tokens)
            text = prompt
        else:
            if any(type(t) is not int or not 0 <= t < self.tok.vocab_size for t in prompt):
                raise ValueError("prompt: token ids must be within the vocabulary")
            ids, text = list(prompt), None
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        return ProcessedPrompt(ids, [], text)

    def prompt_text(self, prompt: ProcessedPrompt) -> str:
        """The prompt's text (decoded from its ids when it came as ids)."""
        if prompt.text is None:
            prompt.text = self.tok.decode(prompt.token_ids, False)
        return prompt.text

    # --- chat ---------------------------------------------------------------------------
    def check_chat_images(self, messages: list[dict]) -> list[tuple[str, str]]:
        """``(url, part name)`` of the images of plain-JSON ``messages``, checked (cheap)."""
        for i, message in enumerate(messages):
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" and kind not in IMAGE_PART_TYPES:
                    raise ValueError(
                        f"messages[{i}].content[{j}].type: {kind!r} is not supported "
                        "(text or image_url)"
                    )
        urls = []
        for part in image_parts(messages):
            if self.images is None:
                raise ValueError(f"{part.where}: {self.model_id} is not a multimodal model")
            if part.url is None:
                raise ValueError(f"{part.where}: an image part needs image_url.url")
            urls.append((part.url, part.where))
            if len(urls) > self.max_images:
                raise ValueError(f"{part.where}: at most {self.max_images} images per request")
        return urls

    async def chat(
        self,
        messages: list[dict],
        options: dict,
        processor_kwargs: dict | None = None,
        add_special_tokens: bool = False,
    ) -> ProcessedPrompt:
        """OpenAI chat ``messages`` (plain JSON) -> processed prompt; ``options`` are the
        renderer's (``common.chat_template.render_options``). Images are fetched
        concurrently, everything else runs in a worker thread."""
        urls = self.check_chat_images(messages)
        images = await asyncio.gather(
            *(load_image_url_async(u, self.image_limits, w) for u, w in urls)
        )
        return await asyncio.to_thread(
            self.render_chat, messages, images, options, processor_kwargs, add_special_tokens
        )

    def render_chat(
        self,
        messages: list[dict],
        images: list[LoadedImage],
        options: dict | None = None,
        processor_kwargs: dict | None = None,
        add_special_tokens: bool = False,
    ) -> ProcessedPrompt:
        if self.template is None:
            raise ValueError("messages: this model has no chat template")
        chat, _ = template_messages(messages)
        text = self.template.render(chat, **(options or {"add_generation_prompt": True}))
        if processor_kwargs is not None and self.images is None:
            raise ValueError("mm_processor_kwargs: this model takes no image inputs")
        if images:
            check_request_pixels(images, self.image_limits)  # before any image is decoded
            prompt = self.images.process(text, images, add_special_tokens, processor_kwargs)
        else:
            check_processor_kwargs(processor_kwargs)
            ids = self.tok.encode(text, add_special_tokens=add_special_tokens)
            prompt = ProcessedPrompt(ids, [], text)
        if not prompt.token_ids:
            raise ValueError("messages: the rendered prompt has no tokens")
        return prompt

    def prompt_with_images(
        self,
        text: str,
        images: list[LoadedImage],
        add_special_tokens: bool = True,
        processor_kwargs: dict | None = None,
    ) -> ProcessedPrompt:
        """A text prompt holding the model's image markers, with its images (offline API)."""
        if self.images is None:
            raise ValueError("multi_modal_data: this model takes no image inputs")
        check_request_pixels(images, self.image_limits)
        return self.images.process(text, images, add_special_tokens, processor_kwargs)

    # --- a prompt processed upstream ----------------------------------------------------
    def accept(self, wire, cache_salt: str | None = None) -> ProcessedPrompt:
        """A ``processed_prompt`` a previous pod (through the router) made: checked, taken
        as is; its images are named only (their outputs are in the shared store). With the
        pool's key, only one signed for this ``cache_salt`` is taken."""
        prompt = from_wire(wire, self.rules)
        if self.signer is not None:
            self.signer.check(prompt.to_wire(), wire.get(SIGNATURE), cache_salt)
        return prompt

    def to_wire(self, prompt: ProcessedPrompt, cache_salt: str | None = None) -> dict:
        """``prompt`` as the next pod takes it (signed with the pool's key, if any)."""
        wire = prompt.to_wire()
        return wire if self.signer is None else self.signer.sign(wire, cache_salt)

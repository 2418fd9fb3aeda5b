"""Chat templates: where a checkpoint's template is found and how messages become a prompt.

An instruct model converted from Hugging Face or GGUF (``stemlm convert``) keeps its tokenizer's
``chat_template`` (transformers writes it to ``chat_template.jinja`` or ``tokenizer_config.json``;
a GGUF's ``tokenizer.chat_template`` metadata becomes it). The template is rendered with jinja2 in a
sandbox, as transformers does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .api import ApiError


def find_chat_template(ckpt: str | os.PathLike, codec, path: str | os.PathLike | None = None) -> str | None:
    """The template text: ``path`` if given, else the tokenizer's or the checkpoint's, else ``None``."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"chat template file {path} does not exist")
        return path.read_text()
    template = getattr(codec.tokenizer, "chat_template", None) if codec.hf else None
    if isinstance(template, str) and template:
        return template
    ckpt = Path(ckpt)
    for where in (ckpt, ckpt.parent.parent):  # a checkpoint dir, or the run around it
        if (where / "chat_template.jinja").is_file():
            return (where / "chat_template.jinja").read_text()
        config = where / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
            if isinstance(template, str) and template:
                return template
    return None


class ChatTemplate:
    """A compiled template; ``render(messages)`` gives the prompt text ending with the assistant's turn."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` (``role``/``content`` dicts); a ``400`` if the template refuses them."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None

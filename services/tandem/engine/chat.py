"""Chat requests: a conversation rendered into prompt text by the checkpoint's chat template.

The template is the one transformers finds for the checkpoint (tokenizer_config.json's
`chat_template`, or `chat_template.jinja` beside it) and renders it with transformers' own
machinery, so the text is what `apply_chat_template` makes of the same files. The engine
tokenizes that text without adding special tokens: templates write their own BOS, as vLLM
assumes too.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.sampling_params import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class ChatTemplate:
    """The checkpoint's chat template. Loaded on first use, once; safe to use from any thread."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()
        self._loaded = False
        self._tokenizer = None  # transformers' tokenizer, kept for its chat template and special tokens
        self._missing = ""  # why there is no template to render

    def _load(self):
        with self._lock:
            if not self._loaded:
                self._tokenizer, self._missing = self._read()
                self._loaded = True
        return self._tokenizer

    def _read(self):
        if not (self.model_dir / "tokenizer.json").is_file():
            return None, "this model has no tokenizer.json"
        from transformers import PreTrainedTokenizerFast

        try:  # tokenizer.json as it is, whatever tokenizer_class says: the engine tokenizes with that file
            tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
        except Exception as exc:  # noqa: BLE001 - a checkpoint transformers cannot read has no template to use
            log.warning("no chat template: transformers cannot load the tokenizer of %s: %s", self.model_dir, exc)
            return None, f"transformers cannot load this model's tokenizer ({type(exc).__name__}: {exc})"
        if not tokenizer.chat_template:
            return None, "this model has no chat template (tokenizer_config.json's chat_template, chat_template.jinja)"
        return tokenizer, ""

    @property
    def available(self) -> bool:
        return self._load() is not None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        """The prompt text of `messages`. Raises InvalidRequest("messages", ...) when there is no
        template or the template refuses the conversation (its raise_exception message)."""
        import jinja2

        tokenizer = self._load()
        if tokenizer is None:
            raise InvalidRequest("messages", f"{self._missing}: send prompt or prompt_token_ids instead")
        if not messages:
            raise InvalidRequest("messages", "the conversation is empty")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequest("add_generation_prompt", "not with continue_final_message, which leaves the final "
                                 "message open for the model to continue")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=False)
        except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or a template that does not parse
            raise InvalidRequest("messages", f"the chat template refused the conversation: {exc}") from None
        except ValueError as exc:  # e.g. continue_final_message with a final message the template does not show
            raise InvalidRequest("messages", str(exc)) from None

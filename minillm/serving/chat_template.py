"""A chat template: how a list of messages becomes the one prompt a language model continues.

A model trained to chat learned one exact layout of turns (role markers, a
separator, where the answer starts), and its checkpoint ships that layout as a
Jinja template. GPT-2 was never trained to chat and has none, so the server
takes one, as vLLM does, with `--chat-template FILE`; without one,
/v1/chat/completions answers 400. For example (ChatML):

    {% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endfor %}
    {% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}

The template is rendered by Jinja in its sandbox, with the options and globals
that transformers' `apply_chat_template` gives it (`trim_blocks`,
`lstrip_blocks`, `raise_exception`, `bos_token`, `eos_token`), so a template
written for a Hugging Face checkpoint renders here as it does there. A
template's own `raise_exception("...")` (say, for a role it does not know)
becomes a 400 with that message.
"""
from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages, or failed on them; the message says which and why."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template; `render(messages)` gives the prompt text."""

    def __init__(self, source: str, name: str = "the chat template", eos_token: str = "<|endoftext|>"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ValueError(f"{name} is not a valid Jinja template{line}: {e}; fix it, or leave out "
                             "--chat-template") from None
        self.name, self.eos_token, self.source = name, eos_token, source

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str = "<|endoftext|>") -> "ChatTemplate":
        path = Path(path)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot read it ({e}); pass a Jinja template file") from None
        return cls(source, f"--chat-template {path}", eos_token)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.eos_token, eos_token=self.eos_token)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # noqa: BLE001  (sandboxed: whatever it raised, these messages made it raise)
            raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: {e})") \
                from None

"""A Hugging Face chat template: messages -> the prompt text the model was tuned on.

    template = ChatTemplate.from_hf_dir("ckpt/hf")    # None when the model has no template
    text = template.render([{"role": "user", "content": "Hi"}])
    ids = template.tokenize(text)                     # the template writes the special tokens itself

The template is Jinja run in jinja2's immutable sandbox (a template comes with a downloaded model,
so it must not reach Python objects), with the globals and filters Hugging Face templates use:
`raise_exception`, `strftime_now`, `tojson`, and the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...) as variables. A template that raises renders nothing:
ChatTemplateError (a ValueError) carries its message.
"""

import datetime
import json
import os

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from teratron.tokenizers import HuggingFaceTokenizer

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or it is broken)."""


def _raise_exception(message):
    raise ChatTemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.datetime.now().strftime(format_string)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); restore the model's {TOKENIZER_CONFIG}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object; restore the model's {TOKENIZER_CONFIG}")
    return config


def _template_source(folder: str, config: dict):
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or named templates
    of which "default" is the chat one); None when there is none."""
    path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{os.path.join(folder, TOKENIZER_CONFIG)}: chat_template is a {type(source).__name__}, "
                         "not a template string")
    return source


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value  # a serialised AddedToken


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict, tokenizer, where: str):
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{where}: the chat template does not compile ({e}); fix or remove it") from None
        self.special_tokens = special_tokens
        self.tokenizer = tokenizer
        self.where = where

    @classmethod
    def from_hf_dir(cls, folder: str):
        """The template of a Hugging Face tokenizer folder, or None when it has none."""
        if not os.path.isdir(folder):
            return None
        config = _read_config(folder)
        source = _template_source(folder, config)
        if source is None:
            return None
        special = {name: _token_text(config[name]) for name in _SPECIAL_TOKENS
                   if isinstance(_token_text(config.get(name)), str)}
        tokenizer = HuggingFaceTokenizer(folder, include_special_tokens=False)
        return cls(source, special, tokenizer, folder)

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (`messages`: OpenAI's [{"role", "content"}, ...])."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - a template is data: whatever it trips on, the request is refused
            raise ChatTemplateError(f"the chat template of {self.where} failed on these messages "
                                    f"({type(e).__name__}: {e})") from None

    def tokenize(self, text: str) -> list:
        """Token ids of rendered text, adding no special tokens (the template wrote them)."""
        return self.tokenizer.tokenize(text)

"""The tokenizer and chat template of a GGUF, rebuilt from its `tokenizer.*` metadata.

A GGUF carries everything needed to tokenize (vocab, token types, merges, pre-tokenizer name)
but no `tokenizer.json`. We rebuild a byte-level BPE `tokenizers.Tokenizer` that reproduces
llama.cpp's `glm4` tokenization (docs/MODEL.md §12), so a package is self-sufficient. The chat
template is untrusted input, so it only ever runs inside jinja2's immutable sandbox.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from mtpjax.errors import ConversionError
from mtpjax.gguf.control_tokens import ControlTokens

MODEL_KEY = "tokenizer.ggml.model"
PRE_KEY = "tokenizer.ggml.pre"
TOKENS_KEY = "tokenizer.ggml.tokens"
TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"
MERGES_KEY = "tokenizer.ggml.merges"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# Our short names for the special-token id keys llama.cpp writes.
SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
}
# GLM ends a turn with <|user|> (eot) or <|observation|> (eom) as often as with <|endoftext|>;
# stopping on eos alone makes chat run on forever.
STOP_ID_NAMES = ("eos", "eot", "eom")

# llama.cpp's CHATGLM4 split: like GPT-4's, but digits go in groups of up to three.
CHATGLM4_SPLIT_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> split regex. llama.cpp maps "chatglm-bpe" to the same pre-type as
# "glm4"; "glm5" (GLM-5 family) is taken to share the split, as docs/MODEL.md §12 states.
PRE_TOKENIZER_REGEX = {
    "glm4": CHATGLM4_SPLIT_REGEX,
    "glm5": CHATGLM4_SPLIT_REGEX,
    "chatglm-bpe": CHATGLM4_SPLIT_REGEX,
}

# Used when a GGUF has no `tokenizer.chat_template`: the plain GLM-4 turn format.
DEFAULT_GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _byte_level_chars() -> dict[str, int]:
  """GPT-2's byte-level alphabet, char -> byte.

  Printable latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 on,
  in byte order. The streaming decoder needs the raw bytes of each token, which the
  `tokenizers` decoder only gives back already joined into text.
  """
  printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  printable_set = set(printable)
  chars = {chr(b): b for b in printable}
  shifted = (b for b in range(256) if b not in printable_set)
  chars.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
  return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


def _token_text_to_bytes(text: str) -> bytes:
  """Bytes a token stands for, with the `tokenizers` ByteLevel decoder's fallback.

  A token holding any char outside the byte-level alphabet (an added token kept in raw form)
  decodes to its own UTF-8.
  """
  try:
    return bytes(_BYTE_LEVEL_CHARS[c] for c in text)
  except KeyError:
    return text.encode("utf-8")


def _required(metadata: Mapping[str, Any], key: str, path: str | None) -> Any:
  if key not in metadata:
    raise ConversionError(f"GGUF metadata lacks the tokenizer key {key!r}", path=path, field=key,
                          remedy="re-convert the model with llama.cpp's convert_hf_to_gguf.py")
  return metadata[key]


def _is_token_id(value: Any, vocab_size: int) -> bool:
  """An integer (not a bool, NaN or string) naming a token of the vocab."""
  return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _special_ids(metadata: Mapping[str, Any], vocab_size: int, path: str | None) -> dict[str, int]:
  special_ids = {}
  for name, key in SPECIAL_ID_KEYS.items():
    if key not in metadata:
      continue
    token_id = metadata[key]
    if not _is_token_id(token_id, vocab_size):
      raise ConversionError(f"special token id {token_id!r:.40} is not a token id of the vocab "
                            f"(size {vocab_size})", path=path, field=key,
                            remedy=f"fix or drop {key} so that it names a token in {TOKENS_KEY}")
    special_ids[name] = token_id
  return special_ids


def _typed_list(metadata: Mapping[str, Any], key: str, item_type: type, path: str | None,
                default: Any = None) -> list:
  """A tokenizer array key, checked to be a list of `item_type` (bools are not ints)."""
  value = metadata.get(key, default) if default is not None else _required(metadata, key, path)
  if not isinstance(value, list) or not all(
      isinstance(item, item_type) and not isinstance(item, bool) for item in value):
    raise ConversionError(f"GGUF metadata {key} must be an array of {item_type.__name__}",
                          path=path, field=key,
                          remedy="re-convert the model with llama.cpp's convert_hf_to_gguf.py")
  return value


def _parse_merges(merges: Sequence[str], path: str | None) -> list[tuple[str, str]]:
  """`"left right"` pairs; the split searches from index 1 as llama.cpp does."""
  pairs = []
  for index, merge in enumerate(merges):
    cut = merge.find(" ", 1)
    if cut < 0:
      raise ConversionError(f"merge #{index} {merge!r} is not 'left right'", path=path,
                            field=MERGES_KEY, remedy="re-convert the model with llama.cpp")
    pairs.append((merge[:cut], merge[cut + 1:]))
  return pairs


def glm_pre_tokenizer(split_regex: str = CHATGLM4_SPLIT_REGEX) -> pre_tokenizers.Sequence:
  """GLM's pre-tokenization (docs/MODEL.md §12): the split regex, then byte-level mapping."""
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
  ])


def _build_hf_tokenizer(tokens: Sequence[str], merges: list[tuple[str, str]], split_regex: str,
                        control_ids: frozenset[int], user_ids: Sequence[int],
                        path: str | None) -> tokenizers.Tokenizer:
  """The docs/MODEL.md §12 recipe: BPE with `ignore_merges`, regex split, byte level, no extras."""
  vocab: dict[str, int] = {}
  for token_id, text in enumerate(tokens):
    vocab.setdefault(text, token_id)
  try:
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
  except Exception as e:  # tokenizers raises plain Exception for merges outside the vocab
    raise ConversionError(f"cannot build the BPE model: {e}", path=path, field=MERGES_KEY,
                          remedy="re-convert the model with llama.cpp") from e
  hf_tokenizer = tokenizers.Tokenizer(bpe)
  hf_tokenizer.pre_tokenizer = glm_pre_tokenizer(split_regex)
  hf_tokenizer.decoder = decoders.ByteLevel()
  # Control tokens (<|user|>, [gMASK]) must match whole inside text and be skippable when
  # decoding; user-defined ones (<think>) must match whole but are ordinary text.
  hf_tokenizer.add_special_tokens(
      [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(control_ids)])
  hf_tokenizer.add_tokens(
      [AddedToken(tokens[i], special=False, normalized=False) for i in user_ids])
  for token_id in (*sorted(control_ids), *user_ids):
    if hf_tokenizer.token_to_id(tokens[token_id]) != token_id:
      raise ConversionError(f"added token {tokens[token_id]!r} (id {token_id}) appears twice in "
                            "the vocab", path=path, field=TOKENS_KEY,
                            remedy="re-convert the model with llama.cpp")
  return hf_tokenizer


class StreamingDetokenizer:
  """Turns generated ids into text deltas, one token at a time.

  A multi-byte UTF-8 character split across tokens is held back until it is complete, so no
  delta ever carries half a character; the concatenated deltas plus `flush()` equal
  `GgufTokenizer.decode` of the same ids (invalid bytes become U+FFFD in both).
  """

  def __init__(self, tokenizer: GgufTokenizer, *, skip_special: bool = False):
    self._tokenizer = tokenizer
    self._skip_special = skip_special
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def push(self, token_id: int) -> str:
    """Adds one token and returns the text it completes (possibly empty)."""
    if self._skip_special and token_id in self._tokenizer.control_ids:
      return ""
    return self._utf8.decode(self._tokenizer.token_bytes(token_id))

  def flush(self) -> str:
    """Ends the stream: bytes still pending form an incomplete character, shown as U+FFFD."""
    return self._utf8.decode(b"", final=True)


class GgufTokenizer:
  """Byte-level BPE tokenizer of a GLM-family GGUF (`tokenizer.ggml.model` = "gpt2")."""

  def __init__(self, hf_tokenizer: tokenizers.Tokenizer, tokens: Sequence[str],
               control_ids: frozenset[int], special_ids: Mapping[str, int]):
    self.hf_tokenizer = hf_tokenizer
    self.vocab_size = len(tokens)
    self.control_ids = control_ids
    self.special_ids = dict(special_ids)
    self.stop_ids = frozenset(special_ids[n] for n in STOP_ID_NAMES if n in special_ids)
    self._tokens = list(tokens)
    self._token_bytes: dict[int, bytes] = {}

  @classmethod
  def from_metadata(cls, metadata: Mapping[str, Any], *, path: str | None = None) -> GgufTokenizer:
    """Builds the tokenizer from decoded GGUF key/values; `path` only names the file in errors."""
    model = _required(metadata, MODEL_KEY, path)
    if model != "gpt2":
      raise ConversionError(f"tokenizer model {model!r} is not supported (only byte-level BPE, "
                            "'gpt2')", path=path, field=MODEL_KEY,
                            remedy="use a GLM-family GGUF converted by llama.cpp")
    pre = _required(metadata, PRE_KEY, path)
    if not isinstance(pre, str) or pre not in PRE_TOKENIZER_REGEX:
      raise ConversionError(f"pre-tokenizer {pre!r} is not supported", path=path, field=PRE_KEY,
                            remedy=f"use a GGUF whose {PRE_KEY} is one of "
                            f"{sorted(PRE_TOKENIZER_REGEX)}")
    tokens = _typed_list(metadata, TOKENS_KEY, str, path)
    default_types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    token_types = _typed_list(metadata, TOKEN_TYPE_KEY, int, path, default_types)
    if len(token_types) != len(tokens):
      raise ConversionError(f"{len(token_types)} token types for {len(tokens)} tokens", path=path,
                            field=TOKEN_TYPE_KEY, remedy="re-convert the model with llama.cpp")
    merges = _parse_merges(_typed_list(metadata, MERGES_KEY, str, path), path)
    if not merges:
      raise ConversionError("a 'gpt2' vocab needs merges and this one has none", path=path,
                            field=MERGES_KEY, remedy="re-convert the model with llama.cpp")

    control_ids = frozenset(i for i, t in enumerate(token_types) if t == gguf.TokenType.CONTROL)
    user_ids = [i for i, t in enumerate(token_types) if t == gguf.TokenType.USER_DEFINED]
    hf_tokenizer = _build_hf_tokenizer(tokens, merges, PRE_TOKENIZER_REGEX[pre], control_ids,
                                       user_ids, path)
    return cls(hf_tokenizer, tokens, control_ids, _special_ids(metadata, len(tokens), path))

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special-token text inside it is matched whole. No BOS is added:
    GLM templates write `[gMASK]<sop>` themselves."""
    return self.control.encode(text)

  @functools.cached_property
  def control(self) -> ControlTokens:
    """The control tokens, for tokenizing chat prompts with request text kept plain."""
    return ControlTokens(self.hf_tokenizer, {self._tokens[i]: i for i in self.control_ids})

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids`; with `skip_special`, control tokens are left out."""
    return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special)

  def stream_decoder(self, *, skip_special: bool = False) -> StreamingDetokenizer:
    """A fresh per-request detokenizer for streaming replies."""
    return StreamingDetokenizer(self, skip_special=skip_special)

  def token_to_id(self, token: str) -> int | None:
    """Id of a token given in its vocab form (e.g. "<|user|>", "Ġthe"), or None."""
    return self.hf_tokenizer.token_to_id(token)

  def id_to_token(self, token_id: int) -> str:
    return self._tokens[token_id]

  def token_bytes(self, token_id: int) -> bytes:
    """Raw bytes one token stands for (empty for an id the tokenizer does not know)."""
    cached = self._token_bytes.get(token_id)
    if cached is None:
      text = self.hf_tokenizer.id_to_token(token_id)
      cached = b"" if text is None else _token_text_to_bytes(text)
      self._token_bytes[token_id] = cached
    return cached


def _raise_exception(message: str) -> None:
  """Lets a template reject a conversation (HF's `raise_exception`)."""
  raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  """HF's `tojson`: plain `json.dumps`, unlike jinja's HTML-escaping built-in."""
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


class ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """Immutable sandbox in which touching an unsafe attribute fails at once.

  The stock sandbox returns an undefined value that only fails when used further, so
  `{{ x.__class__ }}` would render silently; a probing template should be reported instead.
  """

  def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
    raise jinja2.sandbox.SecurityError(
        f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class ChatTemplate:
  """`tokenizer.chat_template`, rendered the way HF renders chat templates, but sandboxed."""

  def __init__(self, source: str | None = None, *, bos_token: str = "", eos_token: str = "",
               path: str | None = None):
    self.source = source or DEFAULT_GLM_CHAT_TEMPLATE
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.path = path
    try:
      self._template = self._compile(self.source)
    except jinja2.TemplateError as e:
      raise self.error(f"chat template does not compile: {e}") from e

  @staticmethod
  def environment(sandbox: type[ChatSandbox] = ChatSandbox, **options: Any) -> jinja2.Environment:
    """The sandbox HF-style templates render in, with the globals and filters they use."""
    env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                  **options)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env

  def _compile(self, source: str):
    """The compiled template (`gguf/template_budget.py` compiles it under a budget)."""
    return self.environment().from_string(source)

  @classmethod
  def from_metadata(cls, metadata: Mapping[str, Any], *, path: str | None = None,
                    **options: Any) -> ChatTemplate:
    """The GGUF's template (or the GLM default) with its bos/eos token strings; `options` go
    to the constructor (a subclass's own, e.g. a budget)."""
    tokens = metadata.get(TOKENS_KEY, ())
    tokens = tokens if isinstance(tokens, list) else ()

    def token_text(name: str) -> str:
      token_id = metadata.get(SPECIAL_ID_KEYS[name])
      return str(tokens[token_id]) if _is_token_id(token_id, len(tokens)) else ""

    source = metadata.get(CHAT_TEMPLATE_KEY)
    if source is not None and not isinstance(source, str):
      raise ConversionError(f"{CHAT_TEMPLATE_KEY} is a {type(source).__name__}, not a string",
                            path=path, field=CHAT_TEMPLATE_KEY,
                            remedy="store the chat template as a GGUF string, or remove it")
    return cls(source, bos_token=token_text("bos"), eos_token=token_text("eos"), path=path,
               **options)

  def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None, **template_vars: Any) -> str:
    """The prompt text for `messages`; `template_vars` (e.g. `enable_thinking`) pass through."""
    variables = dict(template_vars, messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=self.bos_token, eos_token=self.eos_token)
    if tools is not None:
      variables["tools"] = tools
    try:
      return self._template.render(**variables)
    except jinja2.sandbox.SecurityError as e:
      raise self.error(f"chat template attempted an unsafe operation: {e}") from e
    except jinja2.TemplateError as e:
      raise self.error(f"chat template raised an error: {e.message}") from e
    except Exception as e:  # an untrusted template can fail in any way (1/0, 'a' + 1, ...)
      raise self.error(f"chat template failed: {type(e).__name__}: {e}") from e

  def error(self, message: str) -> ConversionError:
    """The typed error a render failure raises (also for renders made elsewhere, e.g. in a
    child process: `gguf/template_process`)."""
    return ConversionError(message, path=self.path, field=CHAT_TEMPLATE_KEY,
                           remedy="check the request's messages, or replace the GGUF's chat "
                           "template with a trusted one")

"""mtpjax configs: `--config=configs/glm.py[:variant]`, overrides as `--config.group.field=value`.

Variants: the default serves the trained demo package shipped in `mtpjax/assets/glm-demo` and
`tiny` a random tiny model that `mtpjax/testing` builds (fast, for tests), so the main command
runs offline; `glm-4.5-air`, `glm-4.7`, `glm-4.7-flash` and `glm-5` describe
real packages whose path is given with `--config.model.source=/path/to/package-or.gguf`.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from mtpjax.engine.contract import EngineConfig
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.sampling import DEFAULT_MAX_NEW_TOKENS, SamplerParams
from mtpjax.kernels import backend
from mtpjax.testing import embedded_tiny  # noqa: F401  (registers the `embedded:tiny` source)

# Every variant keys its per-model settings as `models.glm`, so one command line
# (`--config.models.glm.speculative.strategy=disabled`) works whatever the variant.
MODEL_NAME = "glm"

# variant -> (GGUF general.architecture, served model name); None is the embedded demo.
_REAL_VARIANTS = {
    "glm-4.5-air": ("glm4moe", "glm-4.5-air"),
    "glm-4.7": ("glm4moe", "glm-4.7"),
    "glm-4.7-flash": ("deepseek2", "glm-4.7-flash"),
    "glm-5": ("glm-dsa", "glm-5"),
}
VARIANTS = ("tiny",) + tuple(_REAL_VARIANTS)


def _speculative() -> ml_collections.ConfigDict:
  """Unset (None) differs from "": None falls through to the next scope (docs/SPECULATIVE.md §2)."""
  return ml_collections.ConfigDict({"strategy": config_dict.placeholder(str),
                                    "max_draft_tokens": config_dict.placeholder(int)})


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  """A locked config: unknown fields (e.g. upstream's `mode`, `draft_*`) are rejected."""
  variant = (variant or "").strip() or None
  if variant is not None and variant not in VARIANTS:
    raise ValueError(f"configs/glm.py: unknown variant {variant!r}; choose one of "
                     f"{', '.join(VARIANTS)} or none for the built-in demo model")
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict()
  # None: required (set --config.model.source); "": the shipped demo package;
  # "embedded:tiny": a generated random tiny model (mtpjax/testing/embedded_tiny.py).
  config.model.source = config_dict.placeholder(str)
  config.model.name = MODEL_NAME
  config.model.arch = "glm4moe"
  config.model.dtype = "float32"     # activations (and dense weights)
  # "quantized": GGUF-quantized tensors stay integers + scales on the device; "dense":
  # dequantized to `dtype` at load.
  config.model.weights = "quantized"
  # On XLA:CPU, multiply quantized weights with rows rounded to int8 per block, as llama.cpp
  # does (2x faster decode; the weights stay exact, results move by the rows' rounding, and
  # an "auto" KV cache is llama.cpp's float16). None: where the native kernel can (a warning
  # where it cannot); True: a typed error where it cannot; False: float32 rows.
  config.model.int8_activations = config_dict.placeholder(bool)

  config.mesh = ml_collections.ConfigDict()
  config.mesh.stages = 1
  config.mesh.splits = config_dict.placeholder(tuple)   # layer boundaries; None = even split
  config.mesh.tensor = 1

  # Engine and sampling defaults are the library's (EngineConfig, SamplerParams): one set.
  engine, sampler = EngineConfig(), SamplerParams()
  config.engine = ml_collections.ConfigDict()
  config.engine.slots = engine.slots
  # The context length (prompt + generated tokens). Attention reads only the cache pages a
  # sequence holds, so a step costs what it holds (README, "Context length and memory").
  config.engine.max_len = engine.max_len
  # Trunk KV cache pages: rows per page (a power of two dividing the smallest prefill bucket)
  # and pages per layer's pool, shared by all slots; 0 is enough for every slot at max_len.
  # A smaller pool makes requests wait for pages (never fail) and refuses, up front, a
  # request whose prompt + max_tokens could never fit.
  config.engine.kv_page = engine.kv_page
  config.engine.kv_pages = engine.kv_pages
  # The KV cache's values: auto (the activation dtype, model.dtype), bfloat16 or float16 (half
  # a float32 model's KV bytes; float16 is llama.cpp's default) or float32 (README, "Context
  # length and memory").
  config.engine.kv_cache_dtype = engine.kv_cache_dtype
  # Steps one dispatch runs (a burst, on one stage: MTP off's, native MTP's plain and drafting
  # steps): the host's per-step work is paid once for all of them, and the tokens are the
  # same. A burst runs only while no prompt waits to be prefilled beside a free slot, so first
  # tokens are not delayed; a stream gets its tokens that many steps at a time. 1: one step a
  # dispatch.
  config.engine.decode_steps = engine.decode_steps
  # Prompt prefixes (whole pages of the largest bucket) kept for reuse by later prompts that
  # start the same way, least recently used first out; 0 turns prefix caching off.
  config.engine.prefix_cache = engine.prefix_cache
  config.engine.prefill_buckets = engine.prefill_buckets
  config.engine.timing = engine.timing   # syncs after draft/verify for the *_compute_us counters
  config.engine.seed = sampler.seed      # seeds the requests that name none
  # When to draft (AdaptiveDrafting): "cost" pauses drafting while it does not pay in wall time
  # or while a slot's drafts are rejected; "accept_rate" only the latter; "off" always drafts.
  config.engine.adaptive_drafting = AdaptiveDrafting.DEFAULT_MODE
  # Top logprobs per token a step computes while a request asks for logprobs (at most 20,
  # OpenAI's limit); 0: the server refuses logprobs.
  config.engine.logprobs = engine.logprobs
  # The implementations of the hot operations (mtpjax/kernels/backend.py): auto (native on a
  # CPU where the C++ kernels build, else xla), xla (XLA's fusions, every platform), native
  # (XLA:CPU's C++ kernels) or pallas.
  config.engine.kernels = backend.DEFAULT

  config.sampling = ml_collections.ConfigDict()
  config.sampling.temperature = sampler.temperature
  config.sampling.top_k = sampler.top_k
  config.sampling.top_p = sampler.top_p
  config.sampling.max_new_tokens = DEFAULT_MAX_NEW_TOKENS

  config.defaults = ml_collections.ConfigDict()
  config.defaults.speculative = _speculative()
  config.models = ml_collections.ConfigDict()
  config.models[MODEL_NAME] = ml_collections.ConfigDict({"speculative": _speculative()})

  config.server = ml_collections.ConfigDict()
  config.server.host = "127.0.0.1"
  config.server.port = 8000
  config.server.model_name = "mtpjax-glm-demo"
  # Reliability limits (mtpjax/server/limits.py): a bad or hostile request fails alone.
  config.server.max_body_bytes = 4 * 2**20    # larger bodies get 413
  config.server.max_queue = 256               # requests waiting for a slot; beyond: 429
  config.server.request_timeout_s = 600.0     # arrival to last token; 0 disables
  config.server.shutdown_timeout_s = 10.0     # SIGTERM: in-flight requests get this long
  config.server.template_timeout_s = 1.0      # chat template render budget (time)
  config.server.template_max_chars = 4 * 2**20   # chat template render budget (output size)
  config.server.api_key = config_dict.placeholder(str)   # or $MTPJAX_API_KEY; unset: open
  config.server.cors_origins = ()             # e.g. ("http://localhost:3000",); none: no CORS
  config.server.header_timeout_s = 10.0       # a request's headers must arrive by then
  config.server.body_timeout_s = 60.0         # and its body by then; else the socket closes
  config.server.idle_timeout_s = 5.0          # a kept-alive connection with no request closes
  config.server.max_connections = 0           # open sockets; 0: the file limit less 128

  config.distributed = ml_collections.ConfigDict()
  config.distributed.coordinator_address = config_dict.placeholder(str)
  config.distributed.num_processes = config_dict.placeholder(int)
  config.distributed.process_id = config_dict.placeholder(int)

  config.cache_dir = config_dict.placeholder(str)
  # JAX's persistent compilation cache under <cache_dir>/mtpjax/jax-compilation: a second
  # start of the same config reuses the compiled steps (mtpjax/warm_start.py).
  config.compilation_cache = True

  if variant in _REAL_VARIANTS:
    config.model.arch, config.server.model_name = _REAL_VARIANTS[variant]
    config.engine.max_len = 32768
  else:
    config.model.source = ""
  if variant == "tiny":
    config.model.source = "embedded:tiny"
    config.server.model_name = "mtpjax-tiny"
    config.engine.slots = 2
    config.engine.max_len = 64
    config.engine.prefill_buckets = (16, 32)
    config.sampling.max_new_tokens = 16

  config.lock()
  return config

"""Layer packages: read, validate, preflight, plan and write (see docs/LAYER_PACKAGES.md).

Nothing here imports JAX: the package layer yields names, ggml types, shapes and bytes.
The preflight function stays in its module (`mtpjax.package.preflight.preflight`): exporting it
here would shadow the module of the same name.
"""

from mtpjax.package.gguf_kv import KeyValue, read_key_values
from mtpjax.package.integrity import is_hex_sha256, sha256_file
from mtpjax.package.manifest import (FORMAT, MANIFEST_NAME, PACKAGE_ABI_VERSION, Artifact,
                                     ExtensionPolicy, Generation, HfReference, Manifest,
                                     Proposer, SourceFile, SourceModel, SpeculativeDecoding,
                                     Strategy, TensorLocation, WindowPolicy,
                                     check_abi_version, load_manifest, manifest_issues,
                                     manifest_sha256, parse_abi_version, parse_hf_reference,
                                     parse_manifest, read_manifest, source_size_bytes)
from mtpjax.package.planning import StageRange, even_split, explicit_split, plan_stages
from mtpjax.package.reader import (ModelSource, TensorInfo, infer_activation_width, open_source,
                                   stage_selects, tensor_role)
from mtpjax.package.writer import split_gguf
from mtpjax.package.writer_v2 import split_gguf_v2

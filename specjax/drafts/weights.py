"""The draft head's weights as one table: the single place the EAGLE-3 layout is written down.

One row per weight: its place in the specjax param tree, its name in the Llama-EAGLE3 safetensors
file (docs/eagle3-format.md, "Checkpoint layout"), its shape in the specjax layout, its logical axes
(specjax.mesh.RULES), its init and when it exists. What reads the table:

  init                  specjax.drafts.eagle3.init_draft_params (eagle3.init_params, the one needing jax)
  logical axes          specjax.drafts.eagle3.param_logical_axes (logical_axes)
  export key mapping    specjax_converters.eagle3_export.eagle3_state_dict (entries)
  import key mapping    specjax_converters.eagle3_import.read_head (entries, both file layouts)
  expected keys/shapes  specjax_converters.eagle3_validate.expected_weights (entries)

Plain Python (no jax, not even numpy), so the converters (numpy + safetensors) read it. Other
draft kinds have their own table of `DraftWeight` rows (P-EAGLE adds `mask_hidden` to this one; DFlash:
specjax.drafts.dflash_weights.DFLASH_WEIGHTS); every derivation takes (table, config).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

# normal(0, std) (HF `post_init` for linears), all ones (norm scales), or normal(0, 1) (P-EAGLE's
# mask_hidden, which stands in for target hidden states: both references draw it with torch.randn)
INITS = ("normal", "ones", "standard_normal")


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dimension of a weight as a function of the draft config, named as the docs name it."""

    name: str
    of: Callable[[Any], int]

    def __call__(self, cfg) -> int:
        return int(self.of(cfg))

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class DraftWeight:
    """One weight of a draft head.

    `param` is the dotted path of the leaf in the specjax param tree and `file_name` the tensor's
    name in the file. `shape` is the specjax leaf shape; with `transpose` (linear kernels, x@W
    `[in, out]`) the file holds the transpose (HF `[out, in]`), else the same array (norm scales).
    `axes` are the leaf's logical axes; `init` one of INITS. Optional: `when` names a boolean config
    field without which the weight does not exist, and `repeat` gives one weight per i in
    range(start, start + repeat(cfg)), `{i}` in `param` and `file_name` standing for i. Every weight
    is stored in the export dtype.
    """

    param: str
    file_name: str
    shape: tuple[Dim, ...]
    axes: tuple[Optional[str], ...]
    init: str
    transpose: bool
    when: Optional[str] = None
    repeat: Optional[Dim] = None
    start: int = 0

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"draft weight {self.param}: init {self.init!r} is not one of {INITS}")
        if len(self.axes) != len(self.shape):
            raise ValueError(f"draft weight {self.param}: {len(self.axes)} logical axes for {len(self.shape)} dims")
        repeated = self.repeat is not None
        if ("{i}" in self.param) != repeated or ("{i}" in self.file_name) != repeated:
            raise ValueError(f"draft weight {self.param}: `{{i}}` in param and file_name goes with `repeat`")


class Entry(NamedTuple):
    """One weight of a draft with a given config: a table row with `{i}` filled in and its shape."""

    row: DraftWeight
    path: tuple[str, ...]  # specjax param tree path
    file_name: str
    shape: tuple[int, ...]  # specjax layout

    @property
    def file_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.row.transpose else self.shape


# ---------------------------------------------------------------------------------------------
# derivations: functions of (table, config)
# ---------------------------------------------------------------------------------------------
def entries(table: Iterable[DraftWeight], cfg, prefix_map: Optional[Mapping[str, str]] = None) -> list[Entry]:
    """Every weight a draft with config `cfg` has, in table order. `prefix_map` renames file names
    for another file layout ({table prefix: file prefix}, e.g. EAGLE3_FILE_LAYOUTS["speculators"])."""
    out = []
    for row in table:
        if row.when is not None and not getattr(cfg, row.when):
            continue
        for i in (range(row.start, row.start + row.repeat(cfg)) if row.repeat is not None else (None,)):
            name = _fill(row.file_name, i)
            for old, new in (prefix_map or {}).items():
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out.append(Entry(row, tuple(_fill(row.param, i).split(".")), name, tuple(d(cfg) for d in row.shape)))
    return out


def _fill(s: str, i: Optional[int]) -> str:
    return s if i is None else s.replace("{i}", str(i))


def logical_axes(table: Iterable[DraftWeight], cfg) -> dict:
    """The param tree of logical axes (specjax.mesh.RULES names) for a draft with config `cfg`."""
    return nest((e.path, e.row.axes) for e in entries(table, cfg))


def nest(leaves: Iterable[tuple[tuple[str, ...], Any]]) -> dict:
    """A nested dict from (path, leaf) pairs."""
    tree: dict = {}
    for path, value in leaves:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def leaf(tree: Mapping, path: tuple[str, ...]) -> Any:
    """The leaf of a nested dict at `path`."""
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------
# EAGLE-3 (docs/eagle3-format.md, "The draft network" and "Checkpoint layout")
# ---------------------------------------------------------------------------------------------
H = Dim("H", lambda c: c.hidden_size)  # draft width = the target's embedding width
TH = Dim("tH", lambda c: c.target_hidden_size)  # width of one aux chunk
FC_IN = Dim("aux*tH", lambda c: c.num_aux * c.target_hidden_size)  # fc input: the aux chunks concatenated
QKV_IN = Dim("2H", lambda c: 2 * c.hidden_size)  # q/k/v input: [input_layernorm(e), hidden_norm(h)]
Q = Dim("nH*hd", lambda c: c.num_attention_heads * c.head_dim)
KV = Dim("nKV*hd", lambda c: c.num_key_value_heads * c.head_dim)
INTER = Dim("I", lambda c: c.intermediate_size)
VD = Dim("Vd", lambda c: c.draft_vocab_size)
NUM_AUX = Dim("aux", lambda c: c.num_aux)
EXTRA_LAYERS = Dim("N-1", lambda c: c.num_layers - 1)  # decoder layers after the first (draft.num_layers)
ONE = Dim("1", lambda c: 1)

EAGLE3_WEIGHTS: tuple[DraftWeight, ...] = (
    #           specjax param                              file name (Llama-EAGLE3)                    shape         logical axes              init      transpose
    DraftWeight("fc.kernel",                               "fc.weight",                                (FC_IN, H),   (None, "embed"),          "normal", True),
    DraftWeight("midlayer.hidden_norm.scale",              "midlayer.hidden_norm.weight",              (H,),         ("norm",),                "ones",   False),
    DraftWeight("midlayer.input_layernorm.scale",          "midlayer.input_layernorm.weight",          (H,),         ("norm",),                "ones",   False),
    DraftWeight("midlayer.post_attention_layernorm.scale", "midlayer.post_attention_layernorm.weight", (H,),         ("norm",),                "ones",   False),
    DraftWeight("midlayer.self_attn.q_proj.kernel",        "midlayer.self_attn.q_proj.weight",         (QKV_IN, Q),  ("embed", "heads"),       "normal", True),
    DraftWeight("midlayer.self_attn.k_proj.kernel",        "midlayer.self_attn.k_proj.weight",         (QKV_IN, KV), ("embed", "kv_heads"),    "normal", True),
    DraftWeight("midlayer.self_attn.v_proj.kernel",        "midlayer.self_attn.v_proj.weight",         (QKV_IN, KV), ("embed", "kv_heads"),    "normal", True),
    DraftWeight("midlayer.self_attn.o_proj.kernel",        "midlayer.self_attn.o_proj.weight",         (Q, H),       ("heads", "embed"),       "normal", True),
    DraftWeight("midlayer.mlp.gate_proj.kernel",           "midlayer.mlp.gate_proj.weight",            (H, INTER),   ("embed", "mlp"),         "normal", True),
    DraftWeight("midlayer.mlp.up_proj.kernel",             "midlayer.mlp.up_proj.weight",              (H, INTER),   ("embed", "mlp"),         "normal", True),
    DraftWeight("midlayer.mlp.down_proj.kernel",           "midlayer.mlp.down_proj.weight",            (INTER, H),   ("mlp", "embed"),         "normal", True),
    DraftWeight("norm.scale",                              "norm.weight",                              (H,),         ("norm",),                "ones",   False),
    DraftWeight("lm_head.kernel",                          "lm_head.weight",                           (H, VD),      ("embed", "draft_vocab"), "normal", True),
    # EAGLE-3.1: one RMSNorm per aux chunk before fc (docs/eagle3-format.md, "EAGLE-3.1 flags (fc_norm, norm_output)")
    DraftWeight("fc_norm.{i}.scale",                       "fc_norm.{i}.weight",                       (TH,),        ("norm",),                "ones",   False,
                when="fc_norm", repeat=NUM_AUX),
    # P-EAGLE (draft.type p_eagle): the learned stand-in for the aux states of the positions not yet
    # drafted, in the fc input space ([1, 1, aux*tH] as speculators and vLLM store it; vLLM reads it
    # flat and passes it through fc); docs/eagle3-format.md, "P-EAGLE (parallel drafting)"
    DraftWeight("mask_hidden",                             "mask_hidden",                              (ONE, ONE, FC_IN), (None, None, None), "standard_normal", False,
                when="parallel_drafting"),
) + tuple(
    # layers 1..N-1 of a multi-layer head (draft.num_layers = N): plain Llama decoder layers over the
    # first layer's output (q/k/v read H, no hidden_norm), as vLLM's Eagle3 LlamaModel and speculators
    # build them (docs/eagle3-format.md, "Multi-layer heads")
    DraftWeight(f"layers.{{i}}.{name}", f"layers.{{i}}.{fname}", shape, axes, init, transpose,
                repeat=EXTRA_LAYERS, start=1)
    for name, fname, shape, axes, init, transpose in (
        ("input_layernorm.scale",          "input_layernorm.weight",          (H,),     ("norm",),          "ones",   False),
        ("post_attention_layernorm.scale", "post_attention_layernorm.weight", (H,),     ("norm",),          "ones",   False),
        ("self_attn.q_proj.kernel",        "self_attn.q_proj.weight",         (H, Q),   ("embed", "heads"),    "normal", True),
        ("self_attn.k_proj.kernel",        "self_attn.k_proj.weight",         (H, KV),  ("embed", "kv_heads"), "normal", True),
        ("self_attn.v_proj.kernel",        "self_attn.v_proj.weight",         (H, KV),  ("embed", "kv_heads"), "normal", True),
        ("self_attn.o_proj.kernel",        "self_attn.o_proj.weight",         (Q, H),   ("heads", "embed"),    "normal", True),
        ("mlp.gate_proj.kernel",           "mlp.gate_proj.weight",            (H, INTER), ("embed", "mlp"),    "normal", True),
        ("mlp.up_proj.kernel",             "mlp.up_proj.weight",              (H, INTER), ("embed", "mlp"),    "normal", True),
        ("mlp.down_proj.kernel",           "mlp.down_proj.weight",            (INTER, H), ("mlp", "embed"),    "normal", True),
    )
)

# The file layouts that hold this table, as renames of its file names ({table prefix: file prefix}):
# speculators writes the decoder layer as `layers.0.*` instead of `midlayer.*`, same tensors and
# shapes (docs/eagle3-format.md, "Layouts other trainers publish").
EAGLE3_LAYER = "midlayer."
EAGLE3_FILE_LAYOUTS = {"llama": {}, "speculators": {EAGLE3_LAYER: "layers.0."}}

# Not weights, so not rows: the vocab maps written beside them (docs/eagle3-format.md, "d2t and t2d").
# They come from the DraftVocab, not the param tree, have no init or logical axes, and keep their
# own dtype whatever the export dtype: file name -> numpy dtype ([Vd] offsets, [V] mask).
EAGLE3_VOCAB_TENSORS = {"d2t": "int64", "t2d": "bool"}

# Not a row either: the draft's own token embedding (draft.train_embedding, Eagle3Config.train_embedding),
# [V, H] in both the param tree and the file (embed_tokens.weight); a head without it uses the target's.
EAGLE3_EMBED_PARAM = "embed_tokens.embedding"


@dataclasses.dataclass(frozen=True)
class Eagle3Shape:
    """The config fields EAGLE3_WEIGHTS reads. An Eagle3Config has them all; the converters build
    one from a head's config.json (head_shape in specjax_converters.eagle3_validate)."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    num_aux: int
    fc_norm: bool = False
    num_layers: int = 1
    parallel_drafting: bool = False

"""``linearize <command>``: thin commands over the Python API; every option is documented in --help."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import LinearizeError

def teacher_help() -> str:
    """The help of every ``--teacher`` option that takes any teacher spec (``linearize.teacher.load_teacher``)."""
    from .shapes import known

    return ("the softmax teacher: a Hugging Face id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), a local model folder, "
            "a .gguf file, a named teacher (gemma-3-270m, qwen2.5-coder-0.5b), 'default' for the embedded "
            f"SmolLM2-135M-Instruct, or shape:NAME[,layers=N] (NAME: {known()}): that model's architecture with "
            "random weights, built on the device in the dtype, for speed and memory only (quality figures need real "
            "weights); layers=N keeps its first N layers (default: %(default)s)")


DTYPES = ["float32", "bfloat16", "float16"]


def _spec_arguments(p: argparse.ArgumentParser) -> None:
    from .spec import BACKENDS, DECAYS, FEATURE_MAPS, KINDS, NORMS, SPARSE_ANCHORS, SPARSE_PRIORITIES, WINDOW_DTYPES

    g = p.add_argument_group("mixer spec (each flag overrides the same key of --config)")
    g.add_argument("--kind", choices=KINDS, help="lolcats: softmax over a sliding window + linear attention for "
                   "older tokens (LoLCATs); linear: normalised linear attention; supra: shared ReLU-MLP kernel, "
                   "RoPE after it, fixed decay, GroupNorm (SUPRA); delta: softmax over a sliding window + a gated "
                   "delta-rule memory of older tokens (Gated DeltaNet); retnet, striped_mamba: XATL's fresh mixers "
                   "(see linearize xatl). Default: lolcats")
    g.add_argument("--feature-map", choices=FEATURE_MAPS, help="learned feature map for lolcats/linear "
                   "(default hedgehog; supra always uses its square shared t2r kernel)")
    g.add_argument("--feature-dim", type=int, help="feature size per head; hedgehog outputs twice this (default 64)")
    g.add_argument("--window", type=int, help="sliding-window size of the lolcats hybrid (default 64)")
    g.add_argument("--decay", choices=DECAYS, help="supra, linear, retnet: fixed per-head decay, retnet or lightning "
                   "(default: retnet for supra, none otherwise); lolcats: how the linear state of keys older than the "
                   "window fades, per key head: span (fixed horizons from the window to --decay-horizon), learned "
                   "(one learned decay each, same start) or gated (data-dependent gates from the layer input, same "
                   "start); default none (LoLCATs)")
    g.add_argument("--decay-horizon", type=int, metavar="N", help="lolcats with --decay: the longest starting "
                   "horizon in tokens (default: 16 x window); supra, linear, retnet: no head's fixed decay keeps a "
                   "longer horizon than N tokens (default: no cap)")
    g.add_argument("--feature-rope", type=_on_off, metavar="{on,off}", help="lolcats, delta: the feature maps read the "
                   "rotated q/k (on, LoLCATs; the default) or the q/k before RoPE (off: linear terms that do not "
                   "depend on absolute positions)")
    g.add_argument("--keep-sliding", type=_on_off, metavar="{on,off}", help="keep every teacher layer with its own "
                   "sliding window (Gemma 2/3's local layers, Mistral's) as it is and convert only the global ones (on), "
                   "or only where a lolcats window covers it (off, the default)")
    g.add_argument("--norm", choices=NORMS, help="sum: divide by phi(q).sum phi(k); group: GroupNorm per head "
                   "(default: group for supra, sum otherwise; supra with --norm sum --decay none is T2R); lolcats: "
                   "sum (one normaliser for the window's and the linear terms, LoLCATs) or separate (each normalised "
                   "on its own, mixed by a learned weight per head)")
    g.add_argument("--keep-softmax", metavar="I,J", help="comma-separated layer indices that keep softmax attention; "
                   "lolcats also takes auto:K (K layers chosen after stage 1 stay softmax, or auto:F, a share "
                   "0 < F < 1 of the converted layers: by attention-output MSE, or see --auto-softmax-score)")
    g.add_argument("--softmax-window", metavar="W[,I:W2,...]", help="the layers kept softmax (--keep-softmax, auto:K "
                   "too) attend over their last W tokens only, so the student still decodes in constant memory: "
                   "W keys and values per key head in each (0: the whole sequence, the default); I:W2 gives layer I "
                   "a window of its own, e.g. 1280,17:4160,18:4160")
    g.add_argument("--softmax-window-dtype", choices=WINDOW_DTYPES, help="how the window-softmax layers "
                   "(--softmax-window) keep their keys and values: auto (the model's dtype; the default) or float8 "
                   "(e4m3 with a scale per token and key head: about half the bytes of bf16)")
    g.add_argument("--softmax-window-sinks", type=int, metavar="S", help="the window-softmax layers (--softmax-window) "
                   "also see each sequence's first S real tokens once those have left their window (attention sinks): "
                   "S more keys and values per key head in each (0: none, the default)")
    g.add_argument("--sparse-cache", type=int, metavar="S", help="lolcats: tokens per layer and key head kept exactly "
                   "beside the window, by default those whose values are least like the others' (see --sparse-priority); "
                   "0 = off (default)")
    g.add_argument("--sparse-priority", choices=SPARSE_PRIORITIES, help="lolcats with --sparse-cache: which tokens "
                   "the cache keeps: novelty (those whose values are least like the other candidates'; the default), "
                   "recall (those the linear state recalls worst, LoLA) or first (the sequence's first S tokens "
                   "for good: attention sinks)")
    g.add_argument("--sparse-anchor", choices=SPARSE_ANCHORS, help="lolcats with --sparse-cache: which scores set "
                   "the softmax terms' scale against the linear terms: window (the window's, as the hybrid was "
                   "trained; the default) or joint (the largest over window and cache, LoLA's)")
    g.add_argument("--sparse-linear", type=float, metavar="W", help="lolcats with --sparse-cache: the linear terms' "
                   "weight beside the cache, in [0, 1] (1: as trained, the default; 0: the window and the cache "
                   "alone, for retrieval)")
    g.add_argument("--backend", choices=BACKENDS, help="auto: fla CUDA kernels when installed; torch: PyTorch only")
    g.add_argument("--config", type=Path, help="a recipe: a YAML file whose keys are settings (convert: the flags "
                   "above and teacher, or any training recipe's file, whose student it builds, naming in one line the "
                   "settings it leaves to that recipe; lolcats, supra: any of the command's settings, e.g. "
                   "stage1_steps, loss, budget), a run's run_config.json (to run it again), or a packaged recipe's "
                   "name (linearize.recipes.configs); flags win")


SPEC_FLAGS = ("kind", "feature_map", "feature_dim", "window", "decay", "decay_horizon", "feature_rope", "norm",
              "keep_softmax", "softmax_window", "softmax_window_dtype", "softmax_window_sinks", "keep_sliding", "backend", "sparse_cache",
              "sparse_priority", "sparse_anchor", "sparse_linear")


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def _check_sparse_options(args, spec: dict) -> None:
    """``--sparse-priority``, ``--sparse-anchor`` and ``--sparse-linear`` only set how a sparse cache works:
    without one they would do nothing."""
    for flag in ("sparse_priority", "sparse_anchor", "sparse_linear"):
        if getattr(args, flag, None) is not None and not spec.get("sparse_cache"):
            raise LinearizeError(f"--{flag.replace('_', '-')} sets how the sparse cache works; give the cache a size "
                                 "with --sparse-cache S (or sparse_cache in --config)")


def read_recipe(config) -> dict:
    """The mapping in a ``--config`` file: a YAML recipe, a run's ``run_config.json`` (YAML reads JSON),
    or the name of a recipe shipped in the package (``linearize.recipes.configs``, e.g. ``supra_kd``)."""
    import yaml

    if config is None:
        return {}
    path = Path(config)
    if not path.is_file():
        from .recipes.configs import names, packaged

        shipped = packaged(str(config))
        if shipped is None:
            raise LinearizeError(f"no such recipe file: {config} (nor a packaged recipe: {', '.join(names())})")
        path = shipped
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise LinearizeError(f"could not parse {config}: {str(exc).splitlines()[0]}") from None
    if not isinstance(recipe, dict):
        raise LinearizeError(f"{config} must hold a mapping of settings, got {type(recipe).__name__}")
    return recipe


def _spec_from_args(args) -> tuple[dict, dict]:
    """(spec dict, other recipe keys) from --config and the flags, flags winning (``convert``)."""
    recipe = read_recipe(args.config)
    other = {k: recipe.pop(k) for k in ("teacher",) if k in recipe}
    for key in SPEC_FLAGS:
        value = getattr(args, key)
        if value is not None:
            recipe[key] = value
    _check_sparse_options(args, recipe)
    return recipe, other


def _recipe_config(args, make, apply_budget, default_out: str, spec_base: dict, *, command: str | None = None,
                   **fixed):
    """A recipe's config: the budget preset, then the --config file (any field of the recipe's config,
    spec keys at the top or under ``spec``), then the flags; ``fixed``: what the command itself sets;
    ``command``: the recipe's command (default: the one running; ``convert`` reads a recipe's file too).
    Unknown keys in the file fail with one line, before anything loads."""
    from dataclasses import fields, replace

    from .recipes.config import resolve_budget
    from .spec import Spec

    if (command or args.command) == "lolcats" and getattr(args, "config", None) is None \
            and resolve_budget(getattr(args, "budget", None)) == "gpu":  # no file on a GPU: the default's recipe file
        from .recipes.launch import is_main_process
        from .recipes.settings import DEFAULT_CONFIG

        args.config = DEFAULT_CONFIG
        if is_main_process():
            print(f"linearize lolcats: no --config on the gpu budget: the default recipe, {DEFAULT_CONFIG} "
                  "(--config lolcats_mix: the same without its window-softmax layers)")
    recipe = read_recipe(getattr(args, "config", None))
    if "hybrid" in recipe:  # XATL's earlier name for the kept softmax layers (run configs saved before)
        hybrid = recipe.pop("hybrid")
        if hybrid and not recipe.get("keep_softmax"):
            recipe["keep_softmax"] = hybrid
    command = command or args.command
    file_budget = recipe.pop("budget", None)  # the flag wins over the file's
    budget = getattr(args, "budget", None) or file_budget
    spec = {**spec_base, **(recipe.pop("spec", None) or {})}
    spec.update({k: recipe.pop(k) for k in SPEC_FLAGS if k in recipe and k != "keep_softmax"})
    spec.update({k: getattr(args, k) for k in SPEC_FLAGS
                 if k != "keep_softmax" and getattr(args, k, None) is not None})
    _check_sparse_options(args, spec)
    # the flag wins over the file's (top level, then under spec); both file keys leave the recipe either way
    from_file = recipe.pop("keep_softmax", None) or spec.pop("keep_softmax", None)
    spec.pop("keep_softmax", None)
    keep = getattr(args, "keep_softmax", None) or from_file
    auto = lambda x: isinstance(x, str) and x.strip().startswith("auto:")  # noqa: E731
    if keep is not from_file and auto(from_file) and not auto(keep):  # named layers replace the file's auto:K
        for key in ("auto_softmax_score", "auto_softmax_distance", "auto_softmax_long"):  # the file's auto:K's: moot
            recipe.pop(key, None)
    method = recipe.pop("method", None)
    if method is not None and method != fixed.get("method", command):
        raise LinearizeError(f"{args.config} is a {method} recipe; run it with 'linearize {method}'")
    out = str(args.out) if args.out is not None else str(recipe.pop("out", None) or default_out)
    recipe.pop("out", None)
    teacher = args.teacher if args.teacher != "default" else recipe.pop("teacher", None)
    recipe.pop("teacher", None)
    if budget is not None and budget not in ("cpu", "gpu", "paper"):
        raise LinearizeError(f"{args.config}: budget must be cpu, gpu or paper, got {budget!r}")
    cfg = apply_budget(make(out=out), budget)
    names = {f.name for f in fields(cfg)}
    unknown = sorted(set(recipe) - names)
    if unknown:
        raise LinearizeError(f"{args.config}: no setting {', '.join(unknown)} in the {command} recipe; its "
                             f"settings: budget, {', '.join(sorted(names - {'method'}))}, and the spec keys")
    flags = {n: getattr(args, n) for n in names - {"teacher", "out", "spec", "keep_softmax", "method"}
             if getattr(args, n, None) is not None}
    named = isinstance(keep, str) and (keep.strip().startswith("auto:")  # chosen by the recipe: lolcats' auto:K,
                                       or (keep.strip() == "xatl" and command in ("xatl", "orderings")))  # 2, N/2
    if named:
        keep = keep.strip()
    else:
        keep = tuple(Spec(keep_softmax=keep).keep_softmax) if keep else ()
    return replace(cfg, **{**recipe, **fixed, **flags}, teacher=teacher, spec=spec, keep_softmax=keep)


def _load_any(model: str, dtype, device):
    """A linearize checkpoint folder, or else any teacher spec."""
    from . import load, load_teacher

    path = Path(model)
    if path.is_dir() and (path / "config.json").exists() and '"linearize"' in (path / "config.json").read_text():
        return load(path, dtype=dtype, device=device)
    return load_teacher(None if model == "default" else model, dtype=dtype, device=device)


def cmd_convert(args) -> int:
    from . import convert, load_teacher, save
    from .info import describe

    from .spec import Spec

    method = recipe_of(read_recipe(args.config), args.config)
    if method is None:  # a file of spec keys (or none): the spec, flags winning
        spec, other = _spec_from_args(args)
        if spec.get("kind", "lolcats") == "lolcats":  # the student `linearize lolcats` trains by default
            from .recipes.settings import DEFAULT_SPEC

            spec = {**DEFAULT_SPEC, **spec}
        Spec.coerce(spec)  # a bad spec fails here, before the teacher loads
        teacher_spec = args.teacher if args.teacher != "default" else other.get("teacher")
        teacher, tokenizer = load_teacher(teacher_spec, dtype=args.dtype, device=args.device)
        student = convert(teacher, spec, inplace=True)
    else:  # a recipe's file: the student its command would build first, before any training
        cfg, left = _recipe_student(args, method)
        teacher, tokenizer = load_teacher(cfg.teacher, dtype=args.dtype, device=args.device)
        student = cfg.convert_teacher(teacher) if method == "lolcats" else cfg.build(teacher)[0]
        if left:
            print(f"{args.config} is a recipe of 'linearize {method}': convert built its student and leaves that "
                  f"command these settings: {', '.join(left)}")
    out = save(student, tokenizer, args.out)
    print(describe(student))
    print(f"saved {out}")
    return 0


RECIPE_KEYS = ("budget", "spec", "hybrid", "out", "method", "teacher")  # a recipe file's keys besides its config's


def recipe_of(recipe: dict, config) -> str | None:
    """The recipe (``lolcats``, ``supra``, ``xatl``) whose settings ``convert --config`` finds in ``recipe``,
    the file's mapping: None for a file of spec keys (and ``teacher``) alone; else the file's ``method``
    (a run's run_config.json), else ``xatl`` where XATL's own settings appear (arch, transfer, freeze, LIT,
    ``keep_softmax: xatl``), else the first of lolcats and supra whose settings hold every key. A key no
    recipe has fails in one line."""
    from dataclasses import fields

    from .recipes.settings import LolcatsConfig, SupraConfig, UptrainConfig, XatlConfig
    from .spec import Spec

    rest = set(recipe) - {f.name for f in fields(Spec)} - {"teacher"}
    if not rest:
        return None
    recipes = {"lolcats": LolcatsConfig, "supra": SupraConfig, "xatl": XatlConfig}
    if "method" in recipe:
        if recipe["method"] not in recipes:
            raise LinearizeError(f"{config}: method must be one of {', '.join(recipes)}, got {recipe['method']!r}")
        return recipe["method"]
    settings = {name: {f.name for f in fields(cls)} | set(SPEC_FLAGS) | set(RECIPE_KEYS)
                for name, cls in recipes.items()}
    xatl_own = settings["xatl"] - {f.name for f in fields(UptrainConfig)} - set(SPEC_FLAGS) - set(RECIPE_KEYS)
    if rest <= settings["xatl"] and (rest & (xatl_own | {"hybrid"}) or recipe.get("keep_softmax") == "xatl"):
        return "xatl"
    fits = [name for name in ("lolcats", "supra") if rest <= settings[name]]
    if fits:
        return fits[0]
    unknown = sorted(rest - set().union(*settings.values()))
    if unknown:
        raise LinearizeError(f"{config}: no setting {', '.join(unknown)} in any recipe (lolcats, supra, xatl), "
                             "nor a spec key")
    raise LinearizeError(f"{config} mixes settings of different recipes ({', '.join(sorted(rest))}); give one "
                         "recipe's, or name it with method: lolcats, supra or xatl")


def _recipe_student(args, method: str):
    """``(config, left)`` for ``convert --config`` on a ``method`` recipe's file: the recipe's config as its
    command reads the file (flags winning; its settings and spec checked before the teacher loads), and
    the file's keys that building the student does not use, left to the recipe's command."""
    from .recipes.settings import DEFAULT_SPEC, LolcatsConfig, SupraConfig, XatlConfig
    from .spec import Spec

    make, base = {"lolcats": (LolcatsConfig, DEFAULT_SPEC), "supra": (SupraConfig, {"kind": "supra"}),
                  "xatl": (XatlConfig, {})}[method]
    # the budget presets set training lengths and batches only: the student does not depend on them
    cfg = _recipe_config(args, make, lambda config, budget: config, str(args.out), base, command=method)
    named = isinstance(cfg.keep_softmax, str)  # lolcats' auto:K (chosen after stage 1), XATL's layers 2 and N/2
    if method == "xatl":
        cfg.check()  # the transfer map
        used = {"arch", "transfer", "keep_softmax", "hybrid", "seed"}
    else:
        if method == "supra":
            cfg.check()
        Spec.coerce({**cfg.spec, "keep_softmax": [] if named else list(cfg.keep_softmax)})
        used = set(SPEC_FLAGS) - ({"keep_softmax"} if named else set()) | {"spec"}
    left = [k for k in read_recipe(args.config) if k not in used | {"teacher", "method"}]
    return cfg, left


def _read_prompt(path: str) -> str:
    """The prompt from a text file, or from standard input for ``-``."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc
        raise LinearizeError(f"cannot read the prompt file {path}: {why}") from None


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from .eval.cli import apply_sparse_flags, check_sparse_flags
    from .info import provenance_line, untrained_warning

    check_sparse_flags(args)
    prompt = _read_prompt(args.prompt_file) if args.prompt_file is not None else args.prompt
    model, tokenizer = _load_any(args.model, args.dtype, args.device)
    if (line := provenance_line(model)) is not None:
        print(f"[{line}]", file=sys.stderr)
    if (warning := untrained_warning(model, args.model)) is not None:
        print(f"linearize: warning: {warning}", file=sys.stderr)
    apply_sparse_flags(model, args)
    if args.chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise LinearizeError("the prompt is empty after tokenization; give --prompt (or --prompt-file) some text")
    ids = ids.to(next(model.parameters()).device)
    sampling = args.temperature > 0
    # every prompt token is real: without the mask, generate() would take a prompt token equal to the pad
    # id (a chat template's end-of-turn, often) for padding
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=sampling, max_new_tokens=args.max_new_tokens,
              pad_token_id=tokenizer.pad_token_id)
    if sampling:
        kw.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=not args.show_prompt, skip_special_tokens=True)
    decoder = args.decoder
    if decoder == "auto":
        from .convert import mixers

        fast = getattr(model.config, "linearize", None) and all(m.fast_decodable() for m in mixers(model).values())
        decoder = "fast" if fast else "generate"
    start = time.perf_counter()
    with torch.no_grad():
        if decoder == "fast":
            from .fast import fast_generate

            out = fast_generate(model, ids, streamer=streamer, **kw)
        else:  # transformers' own loop (a linearize model's generate() would take the fast decoder)
            from .decode.route import plain_loop

            out = model.generate(ids, streamer=streamer, **plain_loop(model), **kw)
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    print(f"[{new} tokens in {seconds:.1f}s, {new / seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from .info import describe

    model, _ = _load_any(args.model, args.dtype, "cpu")
    if args.length is not None and args.length < 1:
        raise LinearizeError(f"--length must be a positive number of tokens, got {args.length}")
    print(describe(model, args.length))
    return 0


def cmd_lolcats(args) -> int:
    from .recipes import lolcats
    from .recipes.launch import is_main_process

    cfg = _recipe_config(args, lolcats.LolcatsConfig, lolcats.apply_budget, "runs/lolcats", lolcats.DEFAULT_SPEC)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else [None]
    configs = [lolcats.ablation_config(cfg, row) if row else cfg for row in rows]  # every row checked first
    for row, row_cfg in zip(rows, configs):
        results = lolcats.run(row_cfg)
        if is_main_process():
            print(lolcats.summary(results, row or "lolcats"))
    return 0


TRAINING_FLAGS = ("data", "block_len", "batch_size", "grad_accum", "train_blocks", "repeats", "eval_blocks",
                  "eval_steps", "keep_checkpoints", "profile_steps", "gradient_checkpointing", "patience", "seed",
                  "resume")
SCHEDULE_FLAGS = ("compile", "cuda_graph", "steps", "lr", "min_lr", "warmup_steps")
KL_FLAGS = ("kl_temperature", "kl_top_k")


def _training_arguments(p: argparse.ArgumentParser, cls, budgets=("cpu", "gpu")) -> None:
    """Options every training recipe shares: the teacher, the budget preset, and the shared settings of
    ``RunConfig`` (flags derived from ``cls``'s fields)."""
    from .recipes.config import add_flags

    p.add_argument("--teacher", default="default", help=teacher_help())
    p.add_argument("--budget", choices=budgets, default=None,
                   help="token budget preset: cpu (minutes on 2 cores), gpu (~20M tokens; lolcats: 10M per "
                        "stage of books, code and WordNet in 4,096-token blocks, and with no --config the "
                        "lolcats_tiers recipe's window layers on 8,192-token blocks)"
                        + (", paper (2 epochs per stage)" if "paper" in budgets else "")
                        + "; default: gpu on CUDA, cpu otherwise")
    add_flags(p, cls, TRAINING_FLAGS)


def _distill_arguments(p: argparse.ArgumentParser, cls, what: str, align: bool = True) -> None:
    """Learning from the teacher: the loss of the training stage and (uptraining) an alignment stage."""
    from .recipes.config import add_flags, flag_help

    add_flags(p, cls, ("loss",), helps={"loss": f"{what}: {flag_help(cls, 'loss')}"})
    add_flags(p, cls, KL_FLAGS + (("align_steps", "align_lr") if align else ()))


def _uptrain(args, method: str, spec: dict, **fixed) -> int:
    from .recipes import uptrain
    from .recipes.launch import is_main_process

    cfg = _uptrain_config(args, method, spec, f"runs/{method}", **fixed)
    results = uptrain.run(cfg)
    if is_main_process():
        print(uptrain.summary(results, method))
    return 0


def _uptrain_config(args, method: str, spec: dict, default_out: str, **fixed):
    from dataclasses import replace

    from .recipes import uptrain

    def make(out):
        from .recipes.settings import SupraConfig, XatlConfig

        return {"supra": SupraConfig, "xatl": XatlConfig}[method](out=out)

    cfg = _recipe_config(args, make, uptrain.apply_budget, default_out, spec, method=method, **fixed)
    return replace(cfg, spec={**cfg.spec, "kind": cfg.arch}) if method == "xatl" else cfg


def cmd_orderings(args) -> int:
    from .recipes import orderings
    from .recipes.launch import is_main_process

    method = orderings.method_of(args.table)
    if method != "xatl" and any(getattr(args, k) is not None for k in ("arch", "lit_threshold", "lit_patience")):
        raise LinearizeError(f"--arch, --lit-threshold and --lit-patience are XATL's; {args.table} is {method}'s")
    base = _uptrain_config(args, method, {"kind": "supra"} if method == "supra" else {}, f"runs/{args.table}")
    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    rows = [x.strip() for x in args.rows.split(",") if x.strip()] if args.rows is not None else None
    configs = orderings.row_configs(args.table, base, losses, rows)  # every row checked before the teacher loads
    orderings.check_second_seed(base, configs, args.second_seed)
    record = orderings.run(args.table, base, losses, rows, args.second_seed)
    if is_main_process():
        print(record["markdown"])
    return 0


def cmd_supra(args) -> int:
    spec = {"kind": "supra"}
    if args.variant == "t2r":
        spec.update(norm="sum", decay="none")
    return _uptrain(args, "supra", spec)


def cmd_xatl(args) -> int:
    return _uptrain(args, "xatl", {})


def cmd_bench(args) -> int:
    import json
    from dataclasses import asdict

    if args.prefill:
        return _bench_prefill(args)
    from .bench.decode import plots, sweep, table

    model, _ = _load_any(args.model, args.dtype, args.device)
    linearized = bool(getattr(model.config, "linearize", None))
    paths = args.paths or (["fast", "generate"] if linearized else ["generate", "static", "fast"])
    entries = [("student" if linearized else "teacher", model, path) for path in paths]
    if args.teacher != "none":
        teacher, _ = _load_any(args.teacher, args.dtype, args.device)
        entries = [("teacher", teacher, path) for path in args.teacher_paths] + entries
    rows = sweep(entries, args.batch_sizes, args.new_tokens, prompt_len=args.prompt_len, compile=args.compile,
                 prefill_batch=args.prefill_batch, fuse_projections=not args.unfused, prefill_chunk=args.prefill_chunk)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.plots:
        for path in plots(rows, args.plots):
            print(f"wrote {path}")
    return 0


def _bench_prefill(args) -> int:
    """``linearize bench --prefill``: the prefill sweep (``linearize.bench.prefill``)."""
    import json
    from dataclasses import asdict

    from .bench import prefill
    from .bench.train import parse_shape

    shapes = [parse_shape(s) for s in args.prefill]
    model, _ = _load_any(args.model, args.dtype, args.device)
    linearized = bool(getattr(model.config, "linearize", None))
    teacher = model if not linearized else None
    if linearized and args.teacher != "none":
        teacher, _ = _load_any(args.teacher, args.dtype, args.device)
    rows = prefill.sweep(model if linearized else None, teacher, shapes, teacher_paths=args.prefill_teacher_paths,
                         student_paths=args.prefill_paths, warmup=args.prefill_warmup, repeats=args.prefill_repeats)
    print(prefill.table(rows))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    p = argparse.ArgumentParser(
        prog="linearize",
        description="Turn a pretrained softmax-attention language model into a linear-cost one "
                    "(constant memory while generating). Commands:",
        epilog="Run 'linearize <command> --help' for each command's options.")
    p.add_argument("--version", action="version", version=f"linearize {__version__}")
    sub = p.add_subparsers(dest="command", metavar="<command>", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype", choices=DTYPES, help="weights' dtype (default: float32 on CPU, bfloat16 on CUDA)")
    common.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")

    c = sub.add_parser("convert", parents=[common], help="teacher + mixer spec -> standalone checkpoint",
                       description="Replace the teacher's attention layers by linear-cost mixers (reusing its "
                                   "q/k/v/o weights; new feature maps start untrained) and save a standalone "
                                   "checkpoint that 'linearize generate' and linearize.load() read without the teacher. "
                                   "A LoLCATs student (no --kind, or --kind lolcats) starts from the spec 'linearize "
                                   "lolcats' trains by default (Hedgehog features of q/k before RoPE, window 64, gated "
                                   "linear state, sliding-window layers kept); the flags and --config change it "
                                   "(--config lolcats_plain: the paper's student). Which layers keep the teacher's "
                                   "softmax over a window the recipe chooses in training (the default's fourteen, by "
                                   "how they help copying): convert keeps none unless --keep-softmax names them "
                                   "(e.g. --keep-softmax 1,2,7 --softmax-window 1280,1:4160).")
    c.add_argument("--teacher", default="default", help=teacher_help())
    c.add_argument("--out", required=True, type=Path, help="folder to write the checkpoint to")
    _spec_arguments(c)
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", parents=[common], help="checkpoint or teacher + prompt -> streamed text",
                       description="Generate from a linearize checkpoint (recurrent decoding, constant memory) or "
                                   "from any teacher, streaming tokens as they come.")
    g.add_argument("model", nargs="?", default="default", help="a checkpoint folder, or a teacher as in convert")
    g.add_argument("--prompt", default="Once upon a time", help="the prompt text (default: %(default)r)")
    g.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a text file (- : standard input), e.g. "
                   "a long document and a question about it; instead of --prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding (default), >0 to sample")
    g.add_argument("--top-k", type=int, default=50, help="sampling: keep the k most likely tokens (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus probability mass (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--show-prompt", action="store_true", help="echo the prompt before the generated text")
    g.add_argument("--decoder", choices=["auto", "fast", "generate"], default="auto",
                   help="fast = linearize.fast (static state buffers, one CUDA graph per step on GPUs); generate = "
                        "plain transformers generate(); auto = fast for linearized checkpoints (default: %(default)s)")
    from .eval.cli import add_sparse_arguments

    add_sparse_arguments(g, "generate")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", parents=[common], help="what a checkpoint is: base model, mixers, parameters, state size",
                       description="Print a checkpoint's base model, the mixer of every layer, trainable and total "
                                   "parameters, and the decoding state one sequence holds.")
    i.add_argument("model", nargs="?", default="default", help="a checkpoint folder, or a teacher as in convert")
    i.add_argument("--length", type=int, metavar="N", help="also print the decoding state per sequence after N "
                   "tokens (kept softmax layers' KV caches grow with it)")
    i.set_defaults(func=cmd_info)

    from .recipes.config import add_flags
    from .recipes.settings import LolcatsConfig, SupraConfig, UptrainConfig, XatlConfig

    lc = sub.add_parser("lolcats", parents=[common], help="LoLCATs: attention transfer, then LoRA (two stages)",
                        description="Linearize a teacher with LoLCATs: stage 1 trains only the feature maps (and the "
                                    "window weights) so each layer matches its softmax attention (MSE, teacher-forced); "
                                    "stage 2 trains LoRA adapters on next-token loss and merges them. Prints held-out "
                                    "perplexity of the teacher, the converted model and after each stage; writes "
                                    "OUT/final (a standalone checkpoint), OUT/results.json and OUT/metrics.jsonl. With "
                                    "no --config on a GPU (or --budget gpu) it trains the measured default (= --config lolcats_tiers): "
                                    "Hedgehog features of the q/k before RoPE, a gated linear state, the teacher's "
                                    "sliding-window layers kept, 8,192-token blocks of books, code and WordNet, and "
                                    "after stage 1 the 47 % of the layers whose softmax most helps copying kept as the "
                                    "teacher's attention over their last 1,280 tokens, four of them over 4,288, each "
                                    "also seeing the first 4 tokens, keys and values in float8 (constant memory); flags "
                                    "change any of it. The same on 4,096-token blocks with one tier, no sinks, bf16: "
                                    "--config lolcats_wide; without the window layers: --config lolcats_mix; the paper's student on "
                                    "its books: --config lolcats_plain; --budget cpu: a few minutes of the hybrid alone "
                                    "on short blocks of the books.")
    lc.add_argument("--out", type=Path, help="run folder (default: the recipe file's out, else runs/lolcats)")
    _training_arguments(lc, LolcatsConfig, budgets=("cpu", "gpu", "paper"))
    add_flags(lc, LolcatsConfig, ("stage1_lr", "stage1_steps", "stage1_epochs", "layers_per_block", "block_inputs",
                                          "mse_factor", "xent_factor", "stage2_lr", "stage2_steps", "stage2_epochs",
                                          "lora_r", "lora_alpha", "auto_softmax_score", "auto_softmax_distance",
                                          "auto_softmax_long", "cuda_graph"))
    _distill_arguments(lc, LolcatsConfig, "stage 2's loss", align=False)
    lc.add_argument("--rows", help="comma-separated comparison rows at the same budget (LoLCATs Table 5): "
                    "lolcats, swap-finetune, stage1-only, no-window; each writes OUT/<row>")
    _spec_arguments(lc)
    lc.set_defaults(func=cmd_lolcats)

    su = sub.add_parser("supra", parents=[common], help="SUPRA: swap in decayed linear attention, uptrain all weights",
                        description="Convert every attention (but --keep-softmax) to SUPRA attention (shared ReLU-MLP "
                                    "kernel, RoPE after it, fixed per-head decay, GroupNorm) and train all weights on "
                                    "next-token loss: Adam betas (0.9, 0.95), warmup then cosine to --min-lr. Writes "
                                    "OUT/final, OUT/results.json and OUT/metrics.jsonl (the loss curve).")
    su.add_argument("--out", type=Path, help="run folder (default: the recipe file's out, else runs/supra)")
    su.add_argument("--variant", choices=["supra", "t2r"], default="supra",
                    help="t2r: the baseline SUPRA improves on (normaliser instead of GroupNorm, no decay)")
    add_flags(su, SupraConfig, SCHEDULE_FLAGS + ("new_weights_first",))
    _distill_arguments(su, SupraConfig, "training loss")
    _training_arguments(su, SupraConfig)
    _spec_arguments(su)
    su.set_defaults(func=cmd_supra)

    xa = sub.add_parser("xatl", parents=[common], help="XATL: a RetNet/Mamba student built from the teacher's weights",
                        description="Build an LCI architecture of the teacher's shape (RetNet retention or Mamba in "
                                    "each block), copy the shared weights named by --transfer, initialise the rest "
                                    "fresh, and train it with the transferred weights frozen, unfrozen or LIT.")
    xa.add_argument("--out", type=Path, help="run folder (default: the recipe file's out, else runs/xatl)")
    xa.add_argument("--config", type=Path, help="a recipe: a YAML file (or a run's run_config.json, or a packaged "
                    "recipe's name) whose keys are any of this command's settings; flags win")
    xa.add_argument("--keep-softmax", "--hybrid", dest="keep_softmax", metavar="I,J|xatl",
                    help="keep softmax attention at these layers: 'xatl' (layers 2 and N/2, the paper's hybrid) or "
                         "indices such as 2,15 (--hybrid is the same flag)")
    add_flags(xa, XatlConfig, ("arch", "transfer", "freeze", "lit_threshold", "lit_patience") + SCHEDULE_FLAGS
              + ("weight_decay",))
    _distill_arguments(xa, XatlConfig, "training loss")
    _training_arguments(xa, XatlConfig)
    xa.set_defaults(func=cmd_xatl)

    from .recipes.orderings import TABLES

    od = sub.add_parser("orderings", parents=[common], help="the papers' comparison tables (SUPRA Table 3, XATL "
                        "Tables 2 and 3), LM loss and distillation side by side",
                        description="Train every row of one of the papers' comparison tables at the same token "
                                    "budget, once per loss in --losses (the paper's lm, and learning from the teacher), "
                                    "then write OUT/<loss>/<row> runs, OUT/curves.png (validation next-token loss "
                                    "against tokens, one panel per loss) and OUT/orderings.md. Finished rows are kept "
                                    "and an unfinished one resumes when the command runs again.")
    od.add_argument("table", choices=list(TABLES), help="supra-table3: supra, t2r, supra-2step; xatl-table2: "
                    "scratch, E, E+FFN, E+FFN+WO, hybrid; xatl-table3: frozen, unfrozen, lit")
    od.add_argument("--losses", default="lm,kl+lm", help="comma-separated training losses, each a set of rows "
                    "(default: %(default)s)")
    od.add_argument("--out", type=Path, help="folder of the table's runs (default: runs/TABLE)")
    od.add_argument("--config", type=Path, help="a recipe file whose settings every row shares; flags win")
    add_flags(od, UptrainConfig, SCHEDULE_FLAGS + KL_FLAGS, notes={"lr": "the recipe's", "min_lr": "the recipe's",
                                                          "warmup_steps": "the recipe's"})
    add_flags(od, UptrainConfig, ("align_steps", "align_lr"), helps={
        "align_steps": "rows learning from the teacher: an alignment stage of this many steps first (default 0; the "
                       "lm rows never align)"})
    add_flags(od, XatlConfig, ("arch", "lit_threshold", "lit_patience"), helps={  # the XATL tables'
        "arch": "the XATL tables' new token mixer: retnet (default) or striped_mamba (no E+FFN+WO row)"})
    od.add_argument("--rows", metavar="R1,R2", help="only these rows of the table (e.g. scratch,E+FFN)")
    od.add_argument("--second-seed", type=int, metavar="SEED", help="train the two rows of each loss whose held-out "
                    "losses are closest again under this seed (OUT/<loss>/seed<SEED>/<row>); the page weighs the "
                    "paper's ordering against the seed-to-seed difference")
    _training_arguments(od, UptrainConfig)
    od.set_defaults(func=cmd_orderings)

    be = sub.add_parser("bench", parents=[common], help="prefill / decode throughput and memory vs the teacher",
                        description="Time a checkpoint and its teacher over batch sizes and generated lengths, each "
                                    "through the chosen decoding paths: prefill and decode tokens/s, ms per step, "
                                    "cache bytes and (CUDA) peak memory; on CUDA each student row also gets its bandwidth "
                                    "floor (weight and state bytes over a copy's bandwidth measured in the same run: "
                                    "no step can be faster). A size that runs out of memory ends that "
                                    "path's batch sweep. Example (the issue's sweep): --batch-sizes 1 16 256 1024 "
                                    "--new-tokens 1024 4096 32768")
    be.add_argument("model", help="a checkpoint folder, or a teacher spec to time the teacher alone (--teacher none)")
    be.add_argument("--teacher", default="default", help="the model to compare with ('none' to skip; default: %(default)s)")
    be.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64], help="default: %(default)s")
    be.add_argument("--new-tokens", type=int, nargs="+", default=[128], help="generated lengths (default: %(default)s)")
    be.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    be.add_argument("--paths", nargs="+", choices=["generate", "static", "fast"],
                    help="how MODEL decodes: fast = linearize.fast (static state buffers, CUDA graph), generate = "
                         "plain generate(), static = generate() with a static cache (softmax models only; compiled "
                         "on CUDA). Default: fast generate for a linearized checkpoint, all three for a teacher")
    be.add_argument("--teacher-paths", nargs="+", choices=["generate", "static", "fast"],
                    default=["generate", "static"],
                    help="how the teacher decodes: generate = plain generate(), static = generate with a static "
                         "cache (compiled on CUDA), fast = linearize.fast's static KV + CUDA graph "
                         "(default: %(default)s)")
    be.add_argument("--compile", action="store_true", help="the fast path compiles its decode step (torch.compile)")
    be.add_argument("--unfused", action="store_true",
                    help="the fast path keeps q/k/v and gate/up as separate products (default: one product each)")
    be.add_argument("--prefill-batch", type=int, metavar="N",
                    help="the fast path prefills N prompts at a time (large batches; default: all at once)")
    be.add_argument("--prefill-chunk", type=int, metavar="N",
                    help="the generate and static paths prefill N tokens of every prompt at a time (transformers' "
                         "prefill_chunk_size: the activations of N tokens, not the whole prompt's; a long "
                         "context's largest batch; default: the whole prompt at once)")
    be.add_argument("--prefill", nargs="+", metavar="BxT",
                    help="time the prefill alone at these batch x prompt-length shapes instead of decoding (e.g. "
                         "1x1024 32x8192 1x32768): the last token's logits and the cache decoding starts from, "
                         "against the teacher's attention implementations in one run")
    be.add_argument("--prefill-teacher-paths", nargs="+", choices=["sdpa", "flash_attention_2", "eager"],
                    default=["sdpa", "flash_attention_2"],
                    help="--prefill: the teacher's attention implementations (one that cannot run here leaves a "
                         "row with a note; default: %(default)s)")
    be.add_argument("--prefill-paths", nargs="+", choices=["kernels", "torch"], default=["kernels"],
                    help="--prefill: the student's forms of its mixers: kernels = its spec's backend (Triton "
                         "kernels on CUDA), torch = the PyTorch chunked form (default: %(default)s)")
    be.add_argument("--prefill-warmup", type=int, default=2, help="--prefill: untimed passes per shape (default: %(default)s)")
    be.add_argument("--prefill-repeats", type=int, default=5,
                    help="--prefill: timed passes per shape, fewer past 3 s (the median counts; default: %(default)s)")
    be.add_argument("--out", type=Path, help="write the rows as JSON here")
    be.add_argument("--plots", type=Path, metavar="DIR", help="write tok_s_vs_batch.png and memory_vs_length.png here")
    be.set_defaults(func=cmd_bench)

    from .data.cli import add_data_commands

    add_data_commands(sub, common)

    from .eval.cli import add_eval_commands

    add_eval_commands(sub, common)
    return p


# Checked for every command that has the option, before anything loads: (option, rule, what it must be).
ARGUMENT_RULES = [
    *((name, lambda v: v >= 1, "a positive whole number") for name in (
        "batch_size", "grad_accum", "lora_r", "layers_per_block", "eval_steps", "steps", "stage1_steps",
        "stage2_steps", "max_new_tokens", "block_len", "train_blocks", "eval_blocks", "prompt_len", "feature_dim",
        "window", "max_blocks", "prefill_batch", "prefill_chunk", "lora_alpha", "kl_top_k")),
    *((name, lambda v: all(x >= 1 for x in v), "positive whole numbers") for name in ("batch_sizes", "new_tokens")),
    *((name, lambda v: v >= 0, "zero or more") for name in ("temperature", "top_k", "patience", "sparse_cache",
                                                          "keep_checkpoints", "profile_steps",
                                                          "warmup_steps", "stage1_epochs", "stage2_epochs",
                                                          "align_steps")),
    *((name, lambda v: v > 0, "positive") for name in ("lr", "min_lr", "stage1_lr", "stage2_lr", "mse_factor",
                                                       "kl_temperature", "align_lr")),
    ("xent_factor", lambda v: v >= 0, "zero or more"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("sparse_linear", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("repeats", lambda v: 0 <= v <= 1, "in [0, 1]"),
]


def check_arguments(args) -> None:
    """One ``LinearizeError`` for the first option outside its range (``ARGUMENT_RULES``), and for an
    output path that cannot be what the command writes, before any model, data or teacher loads."""
    for name, ok, what in ARGUMENT_RULES:
        value = getattr(args, name, None)
        if value is not None and not isinstance(value, bool) and not ok(value):
            flag = "--" + name.replace("_", "-")
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            raise LinearizeError(f"{flag} must be {what}, got {shown}")
    out = getattr(args, "out", None)
    if getattr(args, "command", None) in ("convert", "lolcats", "supra", "xatl", "orderings") and out is not None \
            and Path(out).exists() and not Path(out).is_dir():
        raise LinearizeError(f"--out {out} is a file; the command writes a folder there")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a write that found no space left on the device:
    an ``OSError`` with ENOSPC, or a library's own error saying so (safetensors' ``SafetensorError``)."""
    import errno

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
        return args.func(args)
    except LinearizeError as exc:
        print(f"linearize: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not disk_full(exc):
            raise
        out = getattr(args, "out", None)
        print(f"linearize: error: no space left on the device writing{f' under {out}' if out else ''}: free some, or "
              "write less (training: --keep-checkpoints N keeps N checkpoints with their optimizer state, 0 none)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

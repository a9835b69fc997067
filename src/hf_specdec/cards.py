"""Model cards for drafters, and publishing them to the Hub with their weights.

:func:`drafter_card` renders ``assets/templates/drafter_card.md`` with huggingface_hub's :class:`ModelCard`: YAML
metadata (``base_model`` = the target, ``library_name``, ``tags`` with ``speculative-decoding`` and the family,
``datasets``, ``license``, ``pipeline_tag``), a usage snippet, the drafter's facts, training details from
``training_record.json`` and a results table from an ``hf-specdec bench`` JSON, with the lossless statement or, for
approximate verifiers, the measured deviation. :func:`push_drafter` uploads a drafter folder plus its card.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

__all__ = ["drafter_card", "push_drafter", "TEMPLATE"]

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "templates", "drafter_card.md")


def _load_bench(bench: str | dict | None) -> dict | None:
    if bench is None or isinstance(bench, dict):
        return bench
    with open(bench, encoding="utf-8") as fh:
        report = json.load(fh)
    if not isinstance(report, dict) or not isinstance(report.get("records"), list):
        raise ValueError(f"{bench} is not an hf-specdec bench report (a JSON object with a 'records' list).")
    return report


def _own_rows(reports: list[dict], own_prefix: str | None = None) -> list[dict]:
    """The bench reports' drafter rows over all prompts, only this drafter's (method names start with
    ``own_prefix``, ``"<family>:<folder>"``) when a report compares several drafters, each with its report's target
    dtype and machine."""
    rows = []
    for report in reports:
        dtype = (report.get("config") or {}).get("target_dtype", "—")
        machine = _machine(report)
        mine = [
            dict(r, dtype=dtype, machine=machine)
            for r in report["records"]
            if r.get("category", "all") == "all" and r.get("kind") == "drafter" and not r.get("skipped")
        ]
        if own_prefix:
            mine = [r for r in mine if str(r.get("method", "")).startswith(own_prefix + " ")] or mine
        rows += mine
    if not rows:
        raise ValueError("The bench report has no measured drafter records to put in the card.")
    return rows


def _results_table(rows: list[dict]) -> tuple[str, bool]:
    """The card's results table (with each row's machine when the rows come from different ones), and whether an
    approximate verifier is among them."""
    approximate = any(r.get("approximate") for r in rows)
    several = len({r["machine"] for r in rows}) > 1
    lines = [
        "| method | target dtype | temperature | batch | τ | c | speedup | verdict | identical to plain generate |"
        + (" hardware |" if several else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if several else ""),
    ]
    for r in rows:
        cost = r.get("draft_cost_ratio")
        lines.append(
            f"| {r['method']} | {r['dtype']} | {r.get('temperature', 0)} | {r.get('batch_size')} | "
            f"{r.get('mean_accepted_length', float('nan')):.2f} | {'—' if cost is None else f'{cost:.2f}'} | "
            f"{_speedup_cell(r)} | {r.get('verdict') or '—'} | {_identity_cell(r)} |"
            + (f" {r['machine']} |" if several else "")
        )
    return "\n".join(lines), approximate


def _why_it_does_not_pay(rows: list[dict]) -> str | None:
    """Where no row of the drafter's is measured faster than plain decoding, why, from the row that drafted most:
    the tokens a pass commits against what the pass costs in plain steps (target pass and drafting)."""
    if any(r.get("verdict") == "faster" for r in rows):
        return None
    measured = [r for r in rows if r.get("predicted_speedup") and r.get("mean_accepted_length")]
    if not measured:
        return None
    r = min(measured, key=lambda row: row.get("plain_step_share") or 0.0)
    tau, predicted = r["mean_accepted_length"], r["predicted_speedup"]
    verify, cost = r.get("verify_cost_ratio"), r.get("draft_cost_ratio")
    parts = ""
    if verify and cost:
        parts = f" (the target's pass over the draft, {verify:.2f}, and drafting at c {cost:.2f} per draft token)"
    line = (
        f"It does not pay where measured: drafting as in `{r['method']}` it commits τ {tau:.2f} tokens per target "
        f"pass, and a pass costs {tau / predicted:.2f} plain steps{parts}, so τ and pass "
        f"cost predict {predicted:.2f}× of plain decoding"
    )
    adaptive = [row for row in rows if row.get("plain_step_share") is not None and "fixed" not in row["method"]]
    if adaptive:
        line += f"; the adaptive length runs {adaptive[0]['plain_step_share']:.0%} of its passes as plain steps"
    return line + "."


def _machine(report: dict) -> str:
    """Where a bench report ran: ``"AMD EPYC (cpu, torch 2.13.0+cpu)"``."""
    hw = report.get("hardware") or {}
    return f"{hw.get('device_name', '?')} ({hw.get('device', '?')}, torch {hw.get('torch', '?')})"


def _kernels(report: dict) -> str | None:
    """Which CPU kernels a bench report's runs used, where it records them: ``"the target's linear layers packed
    (211 layers), the drafters' int8, packed (9 layers)"``."""
    config = report.get("config") or {}
    if "linear_kernels" not in config:
        return None
    text = f"the target's linear layers {config['linear_kernels']}"
    return text + (f", the drafters' {config['draft_kernels']}" if "draft_kernels" in config else "")


def _speedup_cell(r: dict) -> str:
    """The speedup (the median over repeats, as the bench report prints it), with its 95 % interval when the run had
    repeats."""
    cell = f"{r.get('speedup_median', r.get('speedup', float('nan'))):.2f}×"
    interval = r.get("speedup_ci95")
    return cell + (f" [{interval[0]:.2f}–{interval[1]:.2f}]" if interval else "")


def _identity_cell(r: dict) -> str:
    ident = {True: "yes", False: "no", None: "lossless (sampling)"}[r.get("identical")]
    if r.get("identical") is False and r.get("identical_up_to_near_ties"):
        ident = "up to classified near-ties"
    if r.get("approximate"):
        div = r.get("divergence_rate")
        ident = "approximate" + (f": {100 * div:.0f} % of outputs differ" if div is not None else "")
    return ident


def drafter_card(
    drafter_or_dir,
    repo_id: str | None = None,
    bench: str | dict | list | None = None,
    base_model: str | None = None,
    license: str = "apache-2.0",
    datasets: list[str] | None = None,
    recommended_settings: dict | None = None,
    limitations: list[str] | None = None,
    layout: str | None = None,
):
    """Builds a :class:`huggingface_hub.ModelCard` for a drafter (an instance or a saved folder).

    Args:
        drafter_or_dir: the drafter, or its folder (``training_record.json`` there is used for training details).
        repo_id: the Hub repository the card is for (usage snippet).
        bench: ``hf-specdec bench`` JSON reports (a path or dict, or a list of them, e.g. an fp32 and a bf16 run)
            for the results table.
        base_model: the target's Hub id; defaults to the drafter config's ``target_model_name_or_path``.
        license, datasets: card metadata.
        recommended_settings: e.g. ``{"verifier": "asd", "asd_budget": 8.0}`` frozen by ``hf-specdec asd-tune``.
        limitations: extra lines for the limitations section.
        layout: the other project's checkpoint layout the repository holds (``hf-specdec convert --list``), if any.
    """
    from huggingface_hub import ModelCard, ModelCardData

    from .auto import AutoModelForDrafting
    from .registry import get_drafter_spec

    folder = drafter_or_dir if isinstance(drafter_or_dir, (str, os.PathLike)) else None
    drafter = AutoModelForDrafting.from_pretrained(folder) if folder is not None else drafter_or_dir
    cfg = drafter.config
    target = base_model or cfg.target_model_name_or_path
    if not target:
        raise ValueError("The drafter's config does not name its target: pass base_model= (the target's Hub id).")
    spec = get_drafter_spec(cfg.model_type)  # the family's name, display name and card wording
    record = _training_record(folder, base_model)
    benches = [b for b in (bench if isinstance(bench, (list, tuple)) else [bench]) if b is not None]
    reports = [_load_bench(b) for b in benches]
    sources = [os.path.basename(os.fspath(b)) for b in benches if isinstance(b, (str, os.PathLike))]
    folder = os.path.basename(str(getattr(drafter, "name_or_path", "") or "").rstrip("/"))
    prefix = f"{cfg.model_type.removesuffix('_drafter')}:{folder}" if folder else None
    rows = _own_rows(reports, prefix) if reports else []
    results, approximate = _results_table(rows) if rows else ("", False)
    why = _why_it_does_not_pay(rows)
    facts = _facts(drafter, spec, target, layout)
    training = _training_rows(record)
    guarantee = _APPROXIMATE if approximate else _LOSSLESS
    tags = ["speculative-decoding", spec.name, "hf_specdec"]
    card_data = ModelCardData(
        base_model=target,
        library_name="hf_specdec",
        tags=tags,
        datasets=datasets,
        license=license,
        pipeline_tag="text-generation",
    )
    recommended = ""
    if recommended_settings:
        recommended = ", ".join(f"{k}={v!r}" for k, v in recommended_settings.items())
    hardware = " and ".join(dict.fromkeys(_machine(r) for r in reports)) or "—"
    kernels = " / ".join(dict.fromkeys(k for k in map(_kernels, reports) if k))
    link = f"https://huggingface.co/{target}" if target.count("/") == 1 and not os.path.exists(target) else target
    return ModelCard.from_template(
        card_data,
        template_path=TEMPLATE,
        title=f"{spec.label} drafter for {target}",
        family_name=spec.label,
        family_description=spec.card_description,
        target=target,
        target_link=link,
        repo_id=repo_id or "path/to/this/drafter",
        num_draft_tokens=cfg.num_draft_tokens,
        recommended=recommended,
        guarantee=guarantee,
        facts=facts,
        training=training,
        results=results,
        hardware=hardware,
        kernels=kernels,
        sources=", ".join(f"`{name}`" for name in sources),
        limitations=([why] if why else []) + (limitations or []),
    )


_APPROXIMATE = (
    "The results include an **approximate** verifier (ASD): its outputs may differ from the target's own greedy "
    "decoding; the measured deviation is in the results table. With the default verifiers, greedy outputs are "
    "token-identical to plain `generate` and sampling is lossless."
)
_LOSSLESS = (
    "Lossless: greedy outputs are token-identical to plain `generate`, and sampling follows the target's "
    "distribution exactly (rejection sampling)."
)


def _training_record(folder, base_model) -> dict[str, Any]:
    """The folder's ``training_record.json`` (``{}`` without one), refused when it names another target than
    ``base_model``."""
    record: dict[str, Any] = {}
    if folder is not None and os.path.isfile(os.path.join(folder, "training_record.json")):
        with open(os.path.join(folder, "training_record.json"), encoding="utf-8") as fh:
            record = json.load(fh)
        trained_for = (record.get("target") or {}).get("name_or_path")
        # A local folder counts as the Hub model it holds when the names agree (a converted cache folder is
        # lower-case: smollm2-135m-instruct for HuggingFaceTB/SmolLM2-135M-Instruct).
        same = (
            os.path.basename(trained_for.rstrip("/")).lower() == base_model.split("/")[-1].lower()
            if trained_for and base_model
            else True
        )
        if not same:
            raise ValueError(
                f"The training record says this drafter was trained for {trained_for!r}, but the card would name "
                f"{base_model!r} as its target. Pass the right base_model."
            )
    return record


def _facts(drafter, spec, target: str, layout: str | None) -> list[tuple[str, str]]:
    cfg = drafter.config
    own = sum(p.numel() for p in drafter.parameters())
    facts = [
        ("family", f"{spec.label} (`{type(drafter).__name__}`)"),
        ("parameters", f"{own / 1e6:.1f} M (target embeddings / LM head borrowed at generation time, not saved)"),
        (
            "target",
            f"`{target}` ({cfg.target_model_type}, {cfg.target_num_hidden_layers or 'any number of'} layers, hidden "
            f"{cfg.target_hidden_size}, vocabulary {cfg.target_vocab_size})",
        ),  # fmt: skip
        ("draft tokens per step", str(cfg.num_draft_tokens)),
    ]
    if (getattr(cfg, "num_hidden_layers", None) or 1) > 1:
        facts.append(("draft layers", str(cfg.num_hidden_layers)))
    if cfg.target_layer_ids is not None:
        facts.append(("target features", f"`output_hidden_states{list(cfg.target_layer_ids)}`"))
    if cfg.draft_vocab_size and cfg.draft_vocab_size != cfg.target_vocab_size:
        facts.append(("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} tokens"))
    if layout is not None:
        from .convert import LAYOUTS

        facts.append(("checkpoint layout", f"`{layout}`: {LAYOUTS[layout].description} (hf_specdec reads it too)"))
    return facts


def _training_rows(record: dict) -> list[tuple[str, str]]:
    training = []
    if record:
        data = record.get("data") or {}
        training = [
            (
                "data",
                f"{data.get('source') or data.get('prompt_source') or '?'}: "
                f"{data.get('examples', data.get('num_examples', '?'))} examples, "
                f"{data.get('tokens', data.get('total_tokens', '?'))} tokens"
                + (f" ({data['answers']} self-distilled answers)" if data.get("answers") else "")
                + _prefix_note(data, record.get("train_examples")),
            ),
            ("steps", str(record.get("steps"))),
            ("throughput", f"{record.get('tokens_per_second')} tokens/s, peak RSS {record.get('peak_rss_mb')} MB"),
        ]
        final = record.get("final_eval") or {}
        if final:
            training.append(("held-out", ", ".join(f"{k} {v}" for k, v in final.items())))
    return training


def _prefix_note(data: dict, train_examples: int | None) -> str:
    """``"; trained on the first N"`` when a run used a prefix of its data (``max_train_examples``)."""
    limit, total = data.get("max_train_examples"), data.get("examples", data.get("num_examples"))
    if limit is None or train_examples is None or total is None or train_examples >= total:
        return ""
    return f"; trained on the first {train_examples}"


def push_drafter(
    folder: str,
    repo_id: str,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    card: Any = None,
    layout: str | None = None,
    target=None,
    **card_kwargs,
):
    """Uploads a saved drafter folder and its model card (``README.md``) to ``repo_id``; returns the commit info.

    The folder must load with :class:`~hf_specdec.AutoModelForDrafting`. An existing ``README.md`` in it whose
    ``base_model`` names a different target than the drafter's config is refused. With ``layout`` (a registered
    layout, ``hf-specdec convert --list``) the weights are published in that other project's layout instead of
    hf_specdec's (:func:`~hf_specdec.convert.export_drafter`; ``target``, the target model, for layouts that ship
    some of its weights); ``AutoModelForDrafting.from_pretrained(repo_id)`` reads either.
    """
    from huggingface_hub import HfApi, ModelCard

    from .auto import AutoModelForDrafting
    from .convert import export_drafter, exportable_layout

    _check_repo_id(repo_id)
    if layout is not None:
        exportable_layout(layout)  # refused before anything is loaded or uploaded
    _refuse_links_leaving(folder)
    drafter = AutoModelForDrafting.from_pretrained(folder)
    if target is not None:
        drafter.bind_target(target)
    existing = os.path.join(folder, "README.md")
    if card is None and os.path.isfile(existing):
        old = ModelCard.load(existing)
        named = getattr(old.data, "base_model", None)
        expected = card_kwargs.get("base_model") or drafter.config.target_model_name_or_path
        if named and expected and named != expected:
            raise ValueError(
                f"{existing} names {named!r} as the target, but the drafter was made for {expected!r}. Fix the card "
                "or pass base_model= if the config's target name is a local path."
            )
    if card is None:
        card = drafter_card(folder, repo_id=repo_id, layout=layout, **card_kwargs)
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if layout is None:
            drafter.save_pretrained(tmp)
        else:
            export_drafter(drafter, tmp, layout, target=target)
        for extra in ("training_record.json", "evaluation.json"):
            if os.path.isfile(os.path.join(folder, extra)):
                with open(os.path.join(folder, extra), "rb") as src, open(os.path.join(tmp, extra), "wb") as dst:
                    dst.write(src.read())
        card.save(os.path.join(tmp, "README.md"))
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            revision=revision,
            commit_message=commit_message
            or f"Upload {drafter.config.model_type} drafter with hf_specdec"
            + (f" ({layout} layout)" if layout else ""),
        )


def _check_repo_id(repo_id: str) -> None:
    """The Hub's own rule for repository names, said as a push target (not as a folder that could not be found)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(
            f"{repo_id!r} is not a Hub repository id to push to: give 'name' or 'namespace/name', made of letters, "
            "digits, '-', '_' and '.', without '--' or '..', not starting or ending with '-' or '.', at most 96 "
            "characters (e.g. 'my-org/my-drafter')."
        ) from None


def _refuse_links_leaving(folder: str) -> None:
    """Refuses a folder whose files are symlinks to files outside it: push reads and uploads those files (the
    training record, the card), so it would publish what lies elsewhere on this machine."""
    root = os.path.realpath(folder)
    leaving = [
        name
        for name in sorted(os.listdir(folder))
        if os.path.islink(os.path.join(folder, name))
        and os.path.commonpath([root, os.path.realpath(os.path.join(folder, name))]) != root
    ]
    if leaving:
        raise ValueError(
            f"{folder} holds symlinks to files outside it ({', '.join(leaving)}); push would upload what they point "
            "to. Replace them with copies of the files you mean to publish, or remove them."
        )

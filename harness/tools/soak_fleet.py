"""A fleet's soak read from its ledger alone: ledgers merged (`kvchaos ledger merge A.db B.db -o
fleet.db`: shards of a SLURM array, machines without Ray) and the summary of every run a ledger
holds (`kvchaos soak --summary fleet.db`). The summary's result part depends on the seeds alone
(verdicts, fingerprints and digests per seed, incidents by fingerprint with the first and
fastest seed of each): merged shards give the same result as one soak over the union of their
seeds; where the runs ran and how to reproduce each follows it."""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import Counter
from pathlib import Path

from kvchaos.harness.check.verdict import ERROR, EXIT_CODES, FAIL, MISSED
from kvchaos.harness.scenario.options import PATH
from kvchaos.harness.tools.fingerprint import fp_text
from kvchaos.harness.tools.ledger import Ledger, rebuild_command
from kvchaos.harness.tools.soak_summary import EXIT_NONDETERMINISM, exit_meaning

WHERE = "## Where the runs ran"  # the summary's part that is not the seeds' alone
UNEXPECTED_ROWS = 200


def _read(path: Path) -> tuple[list[dict], list[dict]]:
    """(runs, soaks) of a ledger, read only; columns added since it was made get their defaults."""
    if not path.is_file():
        raise ValueError(f"{path}: no such ledger")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        out = []
        for table in ("runs", "soaks"):
            cur = db.execute(f"SELECT * FROM {table} ORDER BY rowid")
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, r)) for r in cur]
            for name, decl in Ledger.ADDED[table].items():
                default = decl.split("DEFAULT ")[-1].strip("'") if "DEFAULT" in decl else None
                if default is not None and default.isdigit():
                    default = int(default)
                for r in rows:
                    r.setdefault(name, default)
            out.append(rows)
        db.close()
    except sqlite3.Error as e:
        raise ValueError(f"{path}: not a readable ledger: {e}") from None
    return out[0], out[1]


def _key(row: dict) -> tuple:
    """The same run, whichever ledger holds it: its seed, manager, scenario and commit."""
    return (row["seed"], row["block_manager"], row["scenario_json"], row["commit_sha"])


def merge(sources: list[Path], out: Path) -> dict:
    """Every run of the sources into out (made, or added to), each run once; a deleted folder's
    rebuild command names out's row. Returns {"runs", "duplicates", "soaks"} added."""
    if any(Path(s).resolve() == Path(out).resolve() for s in sources):
        raise ValueError(f"-o {out}: is one of the ledgers to merge")
    read = [(Path(s), *_read(Path(s))) for s in sources]  # every source readable, then write
    led = Ledger(Path(out))
    seen = {_key(r) for r in led.rows()}
    got = Counter()
    for _, runs, soaks in read:
        for s in soaks:
            cols = ", ".join(s)
            cur = led.db.execute(
                f"INSERT OR IGNORE INTO soaks ({cols}) VALUES ({', '.join('?' * len(s))})",
                tuple(s.values()),
            )
            got["soaks"] += cur.rowcount
        for r in runs:
            if _key(r) in seen:
                got["duplicates"] += 1
                continue
            seen.add(_key(r))
            row = {k: v for k, v in r.items() if k != "id"}
            new = led.add_run(**row)
            cmd = r["command"] or ""
            if cmd.startswith("python -m kvchaos.harness.tools.ledger "):  # names its old row
                led.folder_deleted(new, rebuild_command(out, new, r["seed"], cmd.split(" && ")[-1]))
            got["runs"] += 1
    led.db.commit()
    led.close()
    return {"runs": got["runs"], "duplicates": got["duplicates"], "soaks": got["soaks"]}


def fleet_summary(path: Path) -> dict:
    """{"result": what the seeds decide, "where": soaks, ledger, reproducing commands}."""
    runs, soaks = _read(path)
    runs.sort(key=lambda r: (r["seed"] is None, r["seed"] or 0, r["block_manager"], r["id"]))
    incidents: dict[tuple, dict] = {}
    repro: dict[str, str] = {}
    for r in runs:
        fps, steps = json.loads(r["fingerprints"] or "[]"), json.loads(r["fp_steps"] or "[]")
        steps += [None] * (len(fps) - len(steps))
        for fp, step in zip(fps, steps):
            inc = incidents.setdefault(tuple(fp), {"count": 0, "first_seed": r["seed"]})
            inc["count"] += 1
            if "fastest_seed" not in inc or (
                step is not None and (inc["fastest_step"] is None or step < inc["fastest_step"])
            ):
                inc.update(fastest_seed=r["seed"], fastest_step=step)
                repro[fp_text(list(fp))] = r["command"] or ""
    verdicts = Counter(r["verdict"] for r in runs)
    mismatches = [r["seed"] for r in runs if r["determinism"] == "mismatch"]
    code = next((EXIT_CODES[v] for v in (MISSED, FAIL) if verdicts[v]), None)
    code = code or (
        EXIT_NONDETERMINISM if mismatches else EXIT_CODES[ERROR] * bool(verdicts[ERROR])
    )
    seeds = [r["seed"] for r in runs if r["seed"] is not None]
    unexpected = [r for r in runs if r["verdict"] in (MISSED, FAIL, ERROR)]
    result = {
        "runs": len(runs),
        "seeds": {"count": len(set(seeds)), "first": min(seeds, default=None)}
        | {"last": max(seeds, default=None)},
        "block_managers": dict(sorted(Counter(r["block_manager"] for r in runs).items())),
        "verdicts": dict(sorted(verdicts.items())),
        "nondeterministic_seeds": mismatches,  # of the sample replayed (where: how many)
        "incidents": [
            {"fingerprint": list(fp), **v}
            for fp, v in sorted(
                incidents.items(), key=lambda kv: (kv[0][0] == "DETECTED", -kv[1]["count"], kv[0])
            )
        ],  # fmt: skip
        "unexpected": [
            {k: r[k] for k in ("seed", "block_manager", "verdict", "summary")}
            for r in unexpected[:UNEXPECTED_ROWS]
        ],
        "per_seed": [
            {
                "seed": r["seed"],
                "block_manager": r["block_manager"],
                "verdict": r["verdict"],
                "fingerprints": json.loads(r["fingerprints"] or "[]"),
                "digest": r["history_digest"],
            }
            for r in runs
        ],
        "exit_code": code,
        "exit_meaning": exit_meaning(code),
    }
    keep = ("id", "started", "finished", "shard", "block_manager", "executor", "workers", "runs")
    where = {
        "ledger": str(path),
        "soaks": [{k: s.get(k) for k in (*keep, "exit_code", "folder")} for s in soaks],
        "commits": sorted({r["commit_sha"] or "?" for r in runs}),
        "replayed": sum(r["determinism"] in ("identical", "mismatch") for r in runs),
        "resubmitted": [
            {"seed": r["seed"], "why": r["resubmitted"]} for r in runs if r["resubmitted"]
        ],
        "reproduce": repro,
    }
    return {"result": result, "where": where}


def render_fleet_md(s: dict) -> str:
    res, where = s["result"], s["where"]
    sd = res["seeds"]
    out = [
        "# kvchaos fleet summary",
        "",
        f"- result: **exit {res['exit_code']}** ({res['exit_meaning']})",
        f"- {res['runs']} runs, {sd['count']} seeds {sd['first']}..{sd['last']}",
        "- block managers: "
        + ", ".join(f"{m} ({n} runs)" for m, n in res["block_managers"].items()),
        "- verdicts: " + (", ".join(f"{v} {n}" for v, n in res["verdicts"].items()) or "none"),
        "- replays whose history differed (nondeterminism): "
        + (", ".join(f"seed {x}" for x in res["nondeterministic_seeds"]) or "none"),
        "",
        "## Incidents by fingerprint",
        "",
        "| fingerprint | runs | first seed | fastest seed (step) |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {fp_text(i['fingerprint'])} | {i['count']} | {i['first_seed']} | "
        f"{i['fastest_seed']} ({i['fastest_step']}) |"
        for i in res["incidents"]
    ] or ["| none | | | |"]
    out += ["", "## Unexpected runs", ""]
    if res["unexpected"]:
        out += ["| verdict | seed | block manager | summary |", "|---|---|---|---|"]
        out += [
            f"| {u['verdict']} | {u['seed']} | {u['block_manager']} | "
            f"{(u['summary'] or '').replace('|', '/')} |"
            for u in res["unexpected"]
        ]
    else:
        out.append("none")
    out += ["", WHERE, "", f"- ledger: `{where['ledger']}`; commits: {', '.join(where['commits'])}"]
    out += [f"- determinism: {where['replayed']} runs replayed (a sample)"]
    out += [
        f"- soak {x['id']}: shard {x['shard']}, {x['runs']} runs under {x['block_manager']} on "
        f"{x['executor']} ({x['workers']} workers), {x['started']}..{x['finished'] or 'unfinished'}"
        f", exit {x['exit_code']}, folder `{x['folder']}`"
        for x in where["soaks"]
    ]
    if where["resubmitted"]:
        out.append(
            "- resubmitted once (worker or node lost): "
            + ", ".join(f"seed {x['seed']} ({x['why']})" for x in where["resubmitted"])
        )
    out += ["", "Reproduce each incident (its fastest run):", ""]
    out += [f"- {fp}: `{cmd}`" for fp, cmd in where["reproduce"].items()] or ["none"]
    return "\n".join(out) + "\n"


def main_summary(path: Path) -> int:
    """`kvchaos soak --summary LEDGER`: LEDGER.summary.md and .json beside it, the md printed."""
    s = fleet_summary(path)
    md = render_fleet_md(s)
    Path(f"{path}.summary.md").write_text(md, encoding="utf-8")
    Path(f"{path}.summary.json").write_text(json.dumps(s, indent=1), encoding="utf-8")
    print(md, end="")
    print(f"summary: {path}.summary.md")
    return s["result"]["exit_code"]


# -- kvchaos ledger merge ---------------------------------------------------------------------
def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = sub.add_parser(
        "merge",
        help="merge soak ledgers into one (each run once)",
        description="Merge soak ledgers (shards of a SLURM array, machines without Ray) into "
        "one; `kvchaos soak --summary OUT` then summarises the fleet.",
    )
    m.add_argument("ledgers", nargs="+", type=PATH, metavar="LEDGER")
    m.add_argument("-o", "--out", type=PATH, required=True, metavar="OUT", help="merged ledger")


def main(args) -> int:
    got = merge([Path(x) for x in args.ledgers], Path(args.out))
    print(
        f"{args.out}: {got['runs']} runs from {len(args.ledgers)} ledgers "
        f"({got['duplicates']} already there skipped), {got['soaks']} soaks",
        file=sys.stdout,
    )
    return 0

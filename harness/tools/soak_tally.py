"""What a soak has seen, as its runs come back (in any order, from any node): the verdict counts,
incidents deduplicated by fingerprint with the first and fastest seed of each, INCONCLUSIVE runs by
cause, the timeline, the ledger row of each run, and which run folders stay (the Keeper). A
resumed soak rebuilds it from its ledger rows first."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

from kvchaos.harness.check.verdict import ERROR, EXIT_CODES, FAIL, MISSED, PASS
from kvchaos.harness.tools.ledger import REFERENCE_NAME, rebuild_command
from kvchaos.harness.tools.soak_summary import (
    EXIT_DISK_CAP,
    EXIT_NONDETERMINISM,
    NONDETERMINISM,
    VERDICT_CODE,
    inconclusive_causes,
)


def _incident(seed, run_dir: str | None, step: int, count: int) -> dict:
    return {
        "count": count,
        "first_seed": seed,
        "first_run": run_dir,
        "fastest_seed": seed,
        "fastest_step": step,
        "fastest_run": run_dir,
    }


class Tally:
    """The Soak's records (a mixin: the soak holds the state, its ledger and keeper)."""

    def _record(self, job: dict, r: dict, duration: float, write: bool = True) -> int | None:
        """Count a run that came back and add its ledger row (write=False: it has one)."""
        seed = job["seed"]
        self.runs += 1
        self.steps += r["steps"]
        if r.get("prefix_cache"):
            self.hit_rates.append(r["prefix_cache"])
        for kind in r.get("performance", ()):  # warnings: the verdict is as it was
            p = self.performance.setdefault(kind, {"runs": 0, "first_seed": seed})
            p["runs"] += 1
            p.setdefault("first_run", r["run_dir"])
        self.counts[r["verdict"]] += 1
        if isinstance(seed, int):
            self.first_seed = seed if self.first_seed is None else min(self.first_seed, seed)
            self.last_seed = seed if self.last_seed is None else max(self.last_seed, seed)
        t = time.monotonic() - self.t0
        self.run_t.append(t)
        self.run_v.append(VERDICT_CODE.get(r["verdict"], VERDICT_CODE[ERROR]))
        for x in r["fingerprints"]:
            fp = tuple(x["fp"])
            inc = self.incidents.get(fp)
            if inc is None:
                self.fp_t.append(t)
                self.new_incidents += 1
                self.incidents[fp] = _incident(seed, r["run_dir"], x["step"], 1)
            else:
                inc["count"] += 1
                if x["step"] < inc["fastest_step"]:
                    self._superseded.append(inc["fastest_run"])
                    inc.update(fastest_seed=seed, fastest_step=x["step"], fastest_run=r["run_dir"])
        if r["verdict"] in (MISSED, FAIL, ERROR) and len(self.unexpected) < 200:
            self.unexpected.append(
                {
                    "seed": seed,
                    "verdict": r["verdict"],
                    "summary": r["summary"],
                    "run_dir": r["run_dir"],
                    "mix": job["scenario"]["scenario"]["description"],
                }
            )
        if r["verdict"] == "INCONCLUSIVE":
            for cause in inconclusive_causes(r["summary"]):
                c = self.causes.setdefault(cause, {"count": 0, "first_seed": seed, "runs": []})
                c["count"] += 1
                if len(c["runs"]) < 3:  # examples to link, kept; the others are sampled
                    c["runs"].append(r["run_dir"])
        if not write:
            return None
        return self.ledger.add_run(
            soak=self.id,
            time=dt.datetime.now().isoformat(timespec="seconds"),
            commit_sha=self.commit,
            scenario=job["scenario"]["scenario"]["name"],
            scenario_json=json.dumps(job["scenario"], sort_keys=True),
            seed=seed if isinstance(seed, int) else None,
            device=self.device,
            verdict=r["verdict"],
            duration_s=round(duration, 3),
            steps=r["steps"],
            command=r["command"],
            history_digest=r["digest"],
            run_dir=r["run_dir"],
            fingerprints=json.dumps([x["fp"] for x in r["fingerprints"]]),
            fp_steps=json.dumps([x["step"] for x in r["fingerprints"]]),
            block_manager=self.args.block_manager or REFERENCE_NAME,
            summary=r["summary"],
            k=job.get("k"),
            node=r.get("node"),
            attempts=job.get("attempt", 1),
            resubmitted=job.get("resubmitted"),
        )

    def _note_replay(self, job: dict, r: dict, row: int, got: dict) -> None:
        """What the run's replay found (replay_one's answer), in the ledger and the counts."""
        if got["cut"]:  # the budget ran out mid-replay
            self.ledger.set_determinism(row, "cut")
            return
        self.replays += 1
        same = got["identical"]
        self.ledger.set_determinism(row, "identical" if same else "mismatch")
        if not same:
            self._mismatch(job, r, got)

    def _mismatch(self, job: dict, r: dict, got: dict) -> None:
        self.nondet.append(
            {
                "seed": job["seed"],
                "run_dir": r["run_dir"],
                "digest": got["recorded_digest"],
                "replay_digest": got["replay_digest"],
                "replay_verdict": got["replay_verdict"],
                "verdict": r["verdict"],
            }
        )
        self.counts[NONDETERMINISM] += 1
        self.nondet_t.append(time.monotonic() - self.t0)
        mix = "+".join(sorted(f["name"] for f in job["scenario"].get("faults", []))) or "-"
        fp = (NONDETERMINISM, mix, "replay", "digest_mismatch")
        inc = self.incidents.setdefault(fp, _incident(job["seed"], r["run_dir"], r["steps"], 0))
        inc["count"] += 1

    def _keep(self, job: dict, r: dict, row: int) -> None:
        """Keep or delete the run's folder (after its replay: a mismatch is a finding)."""
        run_dir = r["run_dir"]
        if run_dir is None:  # lost: nothing on disk, its row can rebuild its scenario
            cmd = rebuild_command(self.ledger_file, row, job["seed"], "")
            self.ledger.folder_deleted(row, cmd)
            return
        cited = {i[k] for i in self.incidents.values() for k in ("first_run", "fastest_run")}
        # INCONCLUSIVE is no finding: keep the examples its cause links to, sample the rest
        examples = {d for c in self.causes.values() for d in c["runs"]}
        if r["verdict"] == "INCONCLUSIVE" and run_dir not in examples:
            why = "passing"
        elif r["verdict"] != PASS or any(m["run_dir"] == run_dir for m in self.nondet[-1:]):
            why = "finding"
        else:
            why = "cited" if run_dir in cited else "passing"
        info = {
            "seed": job["seed"],
            "verdict": r["verdict"],
            "summary": r["summary"],
            "command": r["command"],
            "mix": job["scenario"]["scenario"]["description"].split(": ", 1)[-1],
        }
        self.keeper.settle(run_dir, row, why, info)
        for old in self._superseded:  # a passing run kept only for being the fastest
            if old not in cited:
                self.keeper.release(old, only_cited=True)
        self._superseded.clear()

    def _restore(self, rows: list[dict]) -> None:
        """A resumed soak's state from its ledger rows: counts, incidents, causes, kept runs."""
        for row in sorted(rows, key=lambda x: (x["k"] is None, x["k"] or 0)):
            job = {"seed": row["seed"], "scenario": json.loads(row["scenario_json"] or "{}")}
            job["scenario"].setdefault("scenario", {"name": row["scenario"], "description": ""})
            fps, steps = (
                json.loads(row["fingerprints"] or "[]"),
                json.loads(row["fp_steps"] or "[]"),
            )
            steps += [0] * (len(fps) - len(steps))
            r = {
                "run_dir": row["run_dir"],
                "verdict": row["verdict"],
                "summary": row["summary"] or "",
                "steps": row["steps"] or 0,
                "digest": row["history_digest"],
                "command": row["command"],
                "fingerprints": [{"fp": fp, "step": s} for fp, s in zip(fps, steps)],
            }
            self._record(job, r, row["duration_s"] or 0.0, write=False)
            if row["determinism"] in ("identical", "mismatch"):
                self.replays += 1
            if row["determinism"] == "mismatch":
                got = {"recorded_digest": r["digest"], "replay_digest": "?", "replay_verdict": "?"}
                self._mismatch(job, r, got)
            if row["run_dir"] and Path(row["run_dir"]).is_dir():
                why = "passing" if row["verdict"] == PASS else "finding"
                info = {"seed": row["seed"], "verdict": row["verdict"], "summary": r["summary"]}
                info |= {"command": r["command"], "mix": job["scenario"]["scenario"]["name"]}
                self.keeper.adopt(row["run_dir"], row["id"], why, info)
            self._superseded.clear()
            if row["k"] is not None:
                self.done.add(row["k"])
        self.new_incidents = 0

    def exit_code(self) -> int:
        for v in (MISSED, FAIL):
            if self.counts[v]:
                return EXIT_CODES[v]
        if self.nondet:
            return EXIT_NONDETERMINISM
        if self.counts[ERROR]:
            return EXIT_CODES[ERROR]
        return EXIT_DISK_CAP if self.capped else 0

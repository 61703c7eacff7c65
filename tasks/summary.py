"""A job's summary: one entry per shard plus totals, as data, markdown and a text table.

The flow publishes these as Prefect artifacts and returns the same dict; the CLI
prints the text table. Nothing here holds credentials: entries come from manifests
and error messages, which never contain storage options.
"""

from __future__ import annotations

from typing import Any

from .manifest import ShardManifest

SHARD_COLUMNS = ("shard", "status", "rows", "errors", "prompt_tokens", "completion_tokens", "cached_prompt_tokens",
                 "seconds")


def shard_entry(key: str, status: str, manifest: ShardManifest | None = None,
                message: str | None = None) -> dict[str, Any]:
    """One shard's line: status is done, skipped (already done) or failed (no manifest:
    zero counts)."""
    if manifest is None:
        return {"shard": key, "status": status, "rows": 0, "errors": 0, "invalid_outputs": 0, "prompt_tokens": 0,
                "completion_tokens": 0, "cached_prompt_tokens": 0, "reasoning_tokens": 0, "collapsed_rows": 0,
                "endpoints": [],
                "seconds": 0.0, "message": message}
    return {
        "shard": key,
        "status": status,
        "rows": manifest.rows,
        "errors": manifest.errors,
        "invalid_outputs": manifest.invalid_outputs or 0,  # of the errors: outputs that did not validate
        "prompt_tokens": manifest.prompt_tokens,
        "completion_tokens": manifest.completion_tokens,
        "cached_prompt_tokens": manifest.cached_prompt_tokens,  # prompt tokens the prefix cache held
        "reasoning_tokens": manifest.reasoning_tokens or 0,  # of the completion tokens: the reasoning's
        "collapsed_rows": manifest.collapsed_rows or 0,  # of the rows: copies of an identical row's output
        "endpoints": list(manifest.endpoints),  # the OpenAI endpoints its requests are answered as
        "seconds": round(sum(manifest.seconds.values()), 3) if status == "done" else 0.0,
        "message": message,
    }


def job_summary(entries: list[dict[str, Any]], wall_seconds: float, output: str) -> dict[str, Any]:
    """Totals over ``entries``; tokens/s counts only the shards this run processed."""
    entries = sorted(entries, key=lambda entry: entry["shard"])
    processed = [e for e in entries if e["status"] == "done"]
    generated = sum(e["completion_tokens"] for e in processed)
    prompt = sum(e["prompt_tokens"] for e in processed)
    totals = {
        "shards": len(entries),
        "done": len(processed),
        "skipped": sum(e["status"] == "skipped" for e in entries),
        "failed": sum(e["status"] == "failed" for e in entries),
        "rows": sum(e["rows"] for e in entries),
        "errors": sum(e["errors"] for e in entries),
        "invalid_outputs": sum(e.get("invalid_outputs", 0) for e in entries),
        "prompt_tokens": sum(e["prompt_tokens"] for e in entries),
        "completion_tokens": sum(e["completion_tokens"] for e in entries),
        "cached_prompt_tokens": sum(e["cached_prompt_tokens"] for e in entries),
        "reasoning_tokens": sum(e.get("reasoning_tokens", 0) for e in entries),
        "collapsed_rows": sum(e.get("collapsed_rows", 0) for e in entries),
        "wall_seconds": round(wall_seconds, 3),
        "prompt_tokens_per_second": round(prompt / wall_seconds, 1) if wall_seconds > 0 else 0.0,
        "completion_tokens_per_second": round(generated / wall_seconds, 1) if wall_seconds > 0 else 0.0,
    }
    return {"output": output, "totals": totals, "shards": entries}


def summary_markdown(summary: dict[str, Any]) -> str:
    """Totals and failures as markdown (the flow's markdown artifact)."""
    totals = summary["totals"]
    lines = [
        "# Batch inference summary",
        "",
        f"Output: `{summary['output']}`",
        "",
        "| shards | done | skipped | failed | rows | row errors | prompt tokens | completion tokens "
        "| cached prompt tokens | wall s | prompt tok/s | completion tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| {shards} | {done} | {skipped} | {failed} | {rows} | {errors} | {prompt_tokens} | {completion_tokens} "
        "| {cached_prompt_tokens} | {wall_seconds} | {prompt_tokens_per_second} | {completion_tokens_per_second} |"
        .format(**totals),
    ]
    if totals.get("invalid_outputs"):
        lines += ["", _invalid_outputs_line(totals)]
    if totals.get("collapsed_rows"):
        lines += ["", _collapsed_rows_line(totals)]
    failed = [e for e in summary["shards"] if e["status"] == "failed"]
    if failed:
        lines += ["", "## Failed shards", ""] + [f"- `{e['shard']}`: {e['message']}" for e in failed]
    if summary.get("throughput"):
        lines += ["", "## Throughput over the run", "", "| from | to | rows/s | output tok/s | |",
                  "|---:|---:|---:|---:|:---|"]
        lines += [f"| {start} | {end} | {rows} | {tokens} | {bar} |"
                  for start, end, rows, tokens, bar in _throughput_rows(summary["throughput"])]
    return "\n".join(lines) + "\n"


def _throughput_rows(spans: list[dict[str, Any]], width: int = 30) -> list[tuple[str, str, str, str, str]]:
    """Each span as (from, to, rows/s, tokens/s, a bar of tokens/s scaled to the fastest span)."""
    peak = max(span["tokens_per_second"] for span in spans) or 1.0
    return [(_clock(span["from_seconds"]), _clock(span["to_seconds"]), f"{span['rows_per_second']:.2f}",
             f"{span['tokens_per_second']:.1f}", "█" * round(width * span["tokens_per_second"] / peak))
            for span in spans]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def summary_table(summary: dict[str, Any]) -> str:
    """A plain-text table of the shards and the totals (what the CLI prints)."""
    header: list[str] = list(SHARD_COLUMNS)
    rows = [[str(entry[name]) for name in header] for entry in summary["shards"]]
    totals = summary["totals"]
    rows.append(["TOTAL", f"{totals['done']} done/{totals['skipped']} skipped/{totals['failed']} failed",
                 str(totals["rows"]), str(totals["errors"]), str(totals["prompt_tokens"]),
                 str(totals["completion_tokens"]), str(totals["cached_prompt_tokens"]), str(totals["wall_seconds"])])
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    lines = [render(header), render(["-" * w for w in widths])] + [render(row) for row in rows]
    for entry in summary["shards"]:
        if entry["status"] == "failed":
            lines.append(f"failed {entry['shard']}: {entry['message']}")
    if totals.get("invalid_outputs"):
        lines.append(_invalid_outputs_line(totals))
    if totals.get("collapsed_rows"):
        lines.append(_collapsed_rows_line(totals))
    lines.append(f"completion tokens/s: {totals['completion_tokens_per_second']}   output: {summary['output']}")
    if summary.get("throughput"):
        lines += ["", "throughput over the run (output tokens/s):"]
        lines += [f"  {start}-{end}  {tokens:>10} tok/s  {rows:>8} rows/s  {bar}"
                  for start, end, rows, tokens, bar in _throughput_rows(summary["throughput"])]
    return "\n".join(lines)


def _invalid_outputs_line(totals: dict[str, Any]) -> str:
    return (f"{totals['invalid_outputs']} of the {totals['errors']} row error(s) are structured outputs that did "
            "not validate (their text is kept; the error column says why)")


def _collapsed_rows_line(totals: dict[str, Any]) -> str:
    return (f"{totals['collapsed_rows']} of the {totals['rows']} row(s) repeated another row exactly and were "
            "computed once (their outputs are copies)")


class ShardsFailed(RuntimeError):
    """Some shards failed; the others finished. ``summary`` is the job summary."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardsFailed, (self.args[0], self.summary))


def failure_message(summary: dict[str, Any]) -> str:
    failed = [e for e in summary["shards"] if e["status"] == "failed"]
    first = failed[0]
    return (f"{len(failed)} of {summary['totals']['shards']} shard(s) failed "
            f"(the others are complete; a rerun redoes only these); first: {first['shard']}: {first['message']}")

"""The front page, `GET /`: what is served, warmup progress, the buckets the traffic ran in with
their hits and padding waste, KV-cache use, running and queued requests; live, from `GET /buckets`.

Everything is inline (no external script, style or font), so the page works offline. The bucket
figures are the ones our shards send with every step (engine/serving/shard.py serving_stats):
the busiest buckets, as of the last step; shards that send none (TGI's) leave the table empty.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from router.http.state import RouterState


def waste(real: int, padded: int) -> float:
    return 1 - real / padded if padded else 0.0


def bucket_row(entry: list) -> dict:
    """A shard's compact bucket entry (engine/serving/shard.py bucket_counts) for the page."""
    if entry[0] == "prefill":
        _, batch, seq_len, context, forwards, real, padded = entry
        size = {"seq_len": seq_len, "context_blocks": context}
    else:
        _, batch, blocks, forwards, real, padded = entry
        size = {"num_blocks": blocks}
    return {
        "phase": entry[0],
        "batch_size": batch,
        **size,
        "hits": forwards,
        "real": real,
        "padded": padded,
        "waste": waste(real, padded),
    }


def bucket_order(row: dict) -> tuple:
    return (
        row["phase"] != "prefill",
        row["batch_size"],
        row.get("seq_len", row.get("num_blocks")),
        row.get("context_blocks", 0),
    )


def status(state: RouterState) -> dict:
    """The page's figures: the router's own, and the shards' as of their last step (None: not known
    before it, or from shards that send none)."""
    info, scheduler, stats = state.info, state.scheduler, state.client.serving_stats() or {}
    allocator = scheduler.allocator
    phases = {
        phase: {
            "real": stats[f"{phase}_real"],
            "padded": stats[f"{phase}_padded"],
            "waste": waste(stats[f"{phase}_real"], stats[f"{phase}_padded"]),
        }
        for phase in ("prefill", "decode")
        if f"{phase}_real" in stats
    }
    warmed = stats.get("warmup")
    plan = stats.get("plan_buckets")
    return {
        "model": {
            "id": info["model_id"],
            "device": info["model_device_type"],
            "dtype": info["model_dtype"],
            "attention": info.get("attention_impl"),
            "version": info.get("version"),
        },
        "limits": {
            "max_batch_size": scheduler.limits.max_batch_size,
            "max_input_tokens": info["max_input_tokens"],
            "max_total_tokens": info["max_total_tokens"],
            "max_batch_prefill_tokens": info["max_batch_prefill_tokens"],
        },
        "warmup": {"warmed": warmed[0], "total": warmed[1]} if warmed else None,
        "plan": {"prefill": plan[0], "decode": plan[1]} if plan else None,
        "buckets_used": stats.get("buckets_used"),
        "buckets": sorted(
            (bucket_row(entry) for entry in stats.get("buckets", ())), key=bucket_order
        ),
        "padding": phases,
        "unwarmed_shapes": stats.get("unwarmed_shapes"),
        "graphs_after_warmup": {  # what compiled once serving began (the device's or torch's count)
            kind: stats.get(f"graph_{kind}_serving")
            for kind in ("compiles", "recompiles", "breaks")
        },
        "kv_cache": {
            "blocks_used": allocator.num_used,
            "blocks_total": allocator.num_blocks - 1,
            "block_size": allocator.block_size,
        },
        "requests": {"running": scheduler.running_count, "queued": scheduler.queue_length},
        "shards_available": scheduler.available,
    }


def front_page_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/", response_class=HTMLResponse)
    async def front_page_route():
        return HTMLResponse(PAGE)

    @app.get("/buckets")
    async def buckets_route():
        return JSONResponse(status(state))


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>bucketserve</title>
<style>
:root { --ink: #1d2330; --muted: #667085; --line: #e4e7ec; --accent: #3b6ef5;
        --waste: #e8590c; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--ink); background: #f6f7f9; }
header { padding: 18px 28px; background: #fff; border-bottom: 1px solid var(--line); }
h1 { margin: 0; font-size: 20px; }
h1 small { color: var(--muted); font-weight: 400; font-size: 14px; margin-left: 6px; }
h2 { font-size: 15px; margin: 0 0 10px; }
main { padding: 20px 28px; display: grid; gap: 18px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(200px, 1fr)); gap: 14px; }
.card, section { background: #fff; border: 1px solid var(--line); border-radius: 8px;
                 padding: 14px 16px; }
.label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.value { font-size: 21px; font-weight: 600; margin-top: 2px; white-space: nowrap; }
.bar { height: 8px; background: var(--line); border-radius: 4px; overflow: hidden;
       margin-top: 8px; }
.bar > span { display: block; height: 100%; background: var(--accent); }
.bar.waste > span { background: var(--waste); }
table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: right; padding: 5px 8px; border-bottom: 1px solid var(--line); }
th:first-child, td:first-child { text-align: left; }
th { color: var(--muted); font-weight: 500; font-size: 12px; }
td .bar { width: 90px; display: inline-block; vertical-align: middle; margin: 0 0 0 6px; }
.muted { color: var(--muted); }
.down { color: var(--waste); font-weight: 600; }
</style></head>
<body>
<header><h1>bucketserve<small id="model">loading&hellip;</small></h1></header>
<main>
<div class="cards">
  <div class="card"><div class="label">warmup</div><div class="value" id="warmup">&ndash;</div>
    <div class="bar"><span id="warmup-bar" style="width:0"></span></div></div>
  <div class="card"><div class="label">KV cache</div><div class="value" id="kv">&ndash;</div>
    <div class="bar"><span id="kv-bar" style="width:0"></span></div></div>
  <div class="card"><div class="label">requests</div>
    <div class="value" id="running">&ndash;</div><div class="muted" id="queued"></div></div>
  <div class="card"><div class="label">padding waste</div>
    <div class="value" id="waste">&ndash;</div><div class="muted" id="decode-waste"></div></div>
</div>
<section><h2>Buckets <span class="muted" id="plan"></span></h2>
<table id="buckets"><thead><tr><th>phase</th><th>batch</th><th>seq / blocks</th>
<th>ctx blocks</th><th>hits</th><th>real</th><th>padded</th><th>padding waste</th></tr></thead>
<tbody></tbody></table>
<p class="muted" id="empty">No bucket has run yet: the table fills after the first request.</p>
<p class="muted">real and padded: tokens for prefill, rows for decode.
<span id="unwarmed"></span></p>
</section>
<p class="muted">Live from <a href="/buckets">/buckets</a> every 2 s; also
<a href="/metrics">/metrics</a> and <a href="/info">/info</a>. <span id="shards"></span></p>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const pct = (x) => (100 * x).toFixed(1) + " %";
function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}
function wasteCell(x) {
  const td = cell(pct(x)), bar = document.createElement("div");
  const fill = document.createElement("span");
  bar.className = "bar waste";
  fill.style.width = (100 * x) + "%";
  bar.appendChild(fill);
  td.appendChild(bar);
  return td;
}
function bucketRow(b) {
  const tr = document.createElement("tr");
  tr.className = "bucket " + b.phase;
  const prefill = b.phase === "prefill";
  const cells = [b.phase, b.batch_size, prefill ? b.seq_len : b.num_blocks,
                 prefill ? b.context_blocks : "\u2013", b.hits, b.real, b.padded];
  cells.forEach((v) => tr.appendChild(cell(v)));
  tr.appendChild(wasteCell(b.waste));
  return tr;
}
function planText(s) {
  if (!s.plan) { return ""; }
  const shown = s.buckets.length, used = s.buckets_used;
  return `plan: ${s.plan.prefill} prefill + ${s.plan.decode} decode; ${used} have run` +
    (used > shown ? `, the ${shown} busiest shown` : "");
}
function render(s) {
  const m = s.model;
  $("model").textContent = `${m.id} on ${m.device}, ${m.dtype}` +
    (m.attention ? `, ${m.attention}` : "");
  if (s.warmup) {
    const w = s.warmup, done = w.warmed === w.total;
    $("warmup").textContent = `${w.warmed} / ${w.total} ` + (done ? "warm" : "warming");
    $("warmup-bar").style.width = (w.total ? 100 * w.warmed / w.total : 100) + "%";
  } else {
    $("warmup").textContent = "at the first step";
  }
  const kv = s.kv_cache;
  $("kv").textContent = `${kv.blocks_used} / ${kv.blocks_total} blocks`;
  $("kv-bar").style.width = (kv.blocks_total ? 100 * kv.blocks_used / kv.blocks_total : 0) + "%";
  $("running").textContent = `${s.requests.running} running`;
  $("queued").textContent = `${s.requests.queued} queued`;
  const p = s.padding;
  $("waste").textContent = p.prefill ? `prefill ${pct(p.prefill.waste)}` : "\u2013";
  $("decode-waste").textContent = p.decode ? `decode ${pct(p.decode.waste)} of rows` : "";
  const g = s.graphs_after_warmup || {};
  $("unwarmed").textContent = s.unwarmed_shapes == null ? "" :
    `Forwards at shapes warmup did not run: ${s.unwarmed_shapes}.` + (g.compiles == null ? "" :
    ` After warmup: ${g.compiles} graphs compiled, ${g.recompiles} recompiles, ` +
    `${g.breaks} graph breaks.`);
  $("shards").textContent = s.shards_available ? "" : "The shards are unavailable.";
  $("shards").className = s.shards_available ? "" : "down";
  $("plan").textContent = planText(s);
  $("buckets").tBodies[0].replaceChildren(...s.buckets.map(bucketRow));
  $("empty").hidden = s.buckets.length > 0;
}
async function refresh() {
  try {
    const response = await fetch("/buckets", {cache: "no-store"});
    if (response.ok) { render(await response.json()); }
  } catch (error) {
    $("shards").textContent = "The router does not answer.";
    $("shards").className = "down";
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body></html>
"""

#!/usr/bin/env node
// Load test for `blade serve`: N concurrent streaming clients (default 64) send completion
// requests back to back for a fixed time (default 60 s), then the run stops by itself:
// requests still running at the deadline get a grace period and are then cancelled.
// Prints requests, errors, TTFT / TPOT / end-to-end percentiles, token throughput and the
// server's resident memory at the start and the end (given its PID), so leaks and
// latency regressions show up in one run. Uses Node's built-in fetch only, and refuses any
// URL that is not on the loopback interface.
//
//   node scripts/loadtest.mjs --url http://127.0.0.1:8080 --pid $(pidof blade) [--clients 64]
//        [--duration 60] [--max-tokens 64] [--api-key KEY] [--chat] [--grace 30]

import { readFileSync } from 'node:fs';

import { loopbackUrl, readFlags } from './script-args.mjs';

const usage = `usage: node scripts/loadtest.mjs --url http://127.0.0.1:PORT [options]
  --url URL          the server (loopback only: 127.0.0.0/8, ::1 or localhost)
  --pid PID          the server's process id, to report its RSS at start and end
  --clients N        concurrent streaming clients (default 64)
  --duration S       seconds to keep sending (default 60)
  --max-tokens N     max_tokens of each request (default 64)
  --grace S          seconds requests still running at the deadline may take (default 30)
  --api-key KEY      bearer key (default: the BLADE_API_KEY environment variable)
  --chat             use /v1/chat/completions instead of /v1/completions`;

function parseArgs(argv) {
  const o = { clients: 64, duration: 60, maxTokens: 64, grace: 30, apiKey: process.env.BLADE_API_KEY, chat: false };
  readFlags(argv, (a, value, number) => {
    switch (a) {
      case '--url': o.url = value(); break;
      case '--pid': o.pid = number(1, 2 ** 31); break;
      case '--clients': o.clients = number(1, 4096); break;
      case '--duration': o.duration = number(1, 86400); break;
      case '--max-tokens': o.maxTokens = number(1, 1 << 20); break;
      case '--grace': o.grace = number(0, 3600); break;
      case '--api-key': o.apiKey = value(); break;
      case '--chat': o.chat = true; break;
      case '-h': case '--help': console.log(usage); process.exit(0); break;
      default: throw new Error(`unknown argument '${a}'`);
    }
  });
  o.base = loopbackUrl(o.url, 'this load test').base;
  return o;
}

function rssKiB(pid) {
  if (!pid) return null;
  try {
    const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(/^VmRSS:\s+(\d+) kB/m);
    return m ? Number(m[1]) : null;
  } catch {
    return null;
  }
}

const prompts = ['Once upon a time', 'The little dog', 'Tom and Lily went to the park', 'One day, a cat',
  'There was a big red ball', 'The sun was shining and'];

// One streaming request; resolves to its timings, or throws with a description.
async function one(o, i, signal) {
  const prompt = prompts[i % prompts.length];
  const body = { max_tokens: o.maxTokens, stream: true, stream_options: { include_usage: true }, temperature: 0.8,
    seed: i };
  if (o.chat) body.messages = [{ role: 'user', content: prompt }];
  else body.prompt = prompt;
  const headers = { 'Content-Type': 'application/json' };
  if (o.apiKey) headers.Authorization = `Bearer ${o.apiKey}`;
  const t0 = performance.now();
  const res = await fetch(`${o.base}${o.chat ? '/v1/chat/completions' : '/v1/completions'}`,
    { method: 'POST', headers, body: JSON.stringify(body), signal });
  if (res.status !== 200) {
    const text = await res.text();
    let msg = text.slice(0, 200);
    try { msg = JSON.parse(text).error.message; } catch { /* not JSON: keep the raw text */ }
    throw new Error(`HTTP ${res.status}: ${msg}`);
  }
  const decoder = new TextDecoder();
  let buf = '';
  let tFirst = null;
  let tLast = null;
  let tokens = 0;
  let usage = null;
  let done = false;
  for await (const part of res.body) {
    buf += decoder.decode(part, { stream: true });
    let cut;
    while ((cut = buf.indexOf('\n\n')) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      if (!event.startsWith('data: ')) continue;
      const data = event.slice(6);
      if (data === '[DONE]') { done = true; continue; }
      const j = JSON.parse(data);
      if (j.error) throw new Error(`stream error: ${j.error.message}`);
      if (j.usage) usage = j.usage;
      for (const c of j.choices ?? []) {
        const text = o.chat ? c.delta?.content : c.text;
        if (text) {
          const t = performance.now();
          if (tFirst === null) tFirst = t;
          tLast = t;
          tokens++;
        }
      }
    }
  }
  if (!done) throw new Error('the stream ended without [DONE]');
  const n = usage ? usage.completion_tokens : tokens;
  return {
    ttft: tFirst === null ? null : (tFirst - t0) / 1000,
    tpot: tokens > 1 ? (tLast - tFirst) / 1000 / (tokens - 1) : null,
    e2e: (performance.now() - t0) / 1000,
    tokens: n,
  };
}

function pct(xs, p) {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}

const ms = (x) => (Number.isNaN(x) ? '-' : `${(x * 1000).toFixed(1)} ms`);

async function main() {
  let o;
  try {
    o = parseArgs(process.argv.slice(2));
  } catch (e) {
    console.error(`error: ${e.message}\n\n${usage}`);
    process.exit(2);
  }
  const rssStart = rssKiB(o.pid);
  const stats = { ok: 0, errors: new Map(), ttft: [], tpot: [], e2e: [], tokens: 0 };
  const stopAt = performance.now() + o.duration * 1000;
  const cancel = new AbortController();
  let seq = 0;
  console.log(`loadtest: ${o.clients} streaming clients for ${o.duration} s against ${o.base} (max_tokens ${o.maxTokens})`);
  const t0 = performance.now();
  const client = async () => {
    while (performance.now() < stopAt && !cancel.signal.aborted) {
      try {
        const r = await one(o, seq++, cancel.signal);
        stats.ok++;
        stats.tokens += r.tokens;
        if (r.ttft !== null) stats.ttft.push(r.ttft);
        if (r.tpot !== null) stats.tpot.push(r.tpot);
        stats.e2e.push(r.e2e);
      } catch (e) {
        if (cancel.signal.aborted) break;
        const key = e.cause?.code ? `${e.message} (${e.cause.code})` : e.message;
        stats.errors.set(key, (stats.errors.get(key) ?? 0) + 1);
        // a refused connection or a dead server must not become a busy loop
        await new Promise((r) => setTimeout(r, 100));
      }
    }
  };
  const progress = setInterval(() => {
    const el = (performance.now() - t0) / 1000;
    const errs = [...stats.errors.values()].reduce((a, b) => a + b, 0);
    process.stderr.write(`\r${el.toFixed(0)} s: ${stats.ok} requests, ${errs} errors, ${(stats.tokens / el).toFixed(0)} tokens/s   `);
  }, 1000);
  const all = Promise.all(Array.from({ length: o.clients }, client));
  const deadline = setTimeout(() => cancel.abort(), (o.duration + o.grace) * 1000);
  await all;
  clearTimeout(deadline);
  clearInterval(progress);
  process.stderr.write('\n');
  const el = (performance.now() - t0) / 1000;
  const rssEnd = rssKiB(o.pid);
  const nErr = [...stats.errors.values()].reduce((a, b) => a + b, 0);
  console.log(`requests:   ${stats.ok} ok, ${nErr} errors${cancel.signal.aborted ? ' (stragglers cancelled after the grace period)' : ''}`);
  for (const [k, v] of stats.errors) console.log(`  ${v} x ${k}`);
  console.log(`tokens:     ${stats.tokens} generated in ${el.toFixed(1)} s = ${(stats.tokens / el).toFixed(1)} tokens/s, ${(stats.ok / el).toFixed(2)} requests/s`);
  console.log(`TTFT:       p50 ${ms(pct(stats.ttft, 50))}  p90 ${ms(pct(stats.ttft, 90))}  p99 ${ms(pct(stats.ttft, 99))}`);
  console.log(`TPOT:       p50 ${ms(pct(stats.tpot, 50))}  p90 ${ms(pct(stats.tpot, 90))}  p99 ${ms(pct(stats.tpot, 99))}`);
  console.log(`end to end: p50 ${ms(pct(stats.e2e, 50))}  p90 ${ms(pct(stats.e2e, 90))}  p99 ${ms(pct(stats.e2e, 99))}`);
  if (o.pid)
    console.log(`server RSS: ${rssStart === null ? '?' : (rssStart / 1024).toFixed(1)} MiB at start, ${rssEnd === null ? '?' : (rssEnd / 1024).toFixed(1)} MiB at end (pid ${o.pid})`);
  process.exit(nErr ? 1 : 0);
}

main();

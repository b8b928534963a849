#!/usr/bin/env node
// Header-trickling flood against `blade serve`, to measure how long GET /health waits while it
// runs. N connections each send a request line and then one more header line every few seconds,
// never finishing the request head; a connection the server closes is opened again (as an
// attacker would), so the pressure holds for the whole run. Meanwhile a fresh connection asks
// GET /health once a second and the time to its complete answer is recorded. After the flood
// the script waits a little for the probes still open, then closes every socket and prints the
// /health latencies (probes still unanswered count at the time they had waited).
// Loopback only, bounded in connections and time.
//
//   node scripts/trickle-flood.mjs --url http://127.0.0.1:8080 [--connections 1100] [--interval 3]
//        [--duration 60] [--probe-every 1] [--linger 15]

import net from 'node:net';

import { loopbackUrl, readFlags } from './script-args.mjs';

const usage = `usage: node scripts/trickle-flood.mjs --url http://127.0.0.1:PORT [options]
  --url URL          the server (loopback only: 127.0.0.0/8, ::1 or localhost)
  --connections N    trickling connections to hold (default 1100, at most 20000)
  --interval S       seconds between the header lines of each connection (default 3)
  --duration S       seconds the flood lasts (default 60)
  --probe-every S    seconds between two GET /health probes (default 1)
  --linger S         seconds to wait after the flood for the probes still unanswered (default 15)`;

function parseArgs(argv) {
  const o = { connections: 1100, interval: 3, duration: 60, probeEvery: 1, linger: 15 };
  readFlags(argv, (a, value, number) => {
    switch (a) {
      case '--url': o.url = value(); break;
      case '--connections': o.connections = number(1, 20000); break;
      case '--interval': o.interval = number(0.05, 600); break;
      case '--duration': o.duration = number(1, 3600); break;
      case '--probe-every': o.probeEvery = number(0.05, 600); break;
      case '--linger': o.linger = number(0, 600); break;
      case '-h': case '--help': console.log(usage); process.exit(0); break;
      default: throw new Error(`unknown argument '${a}'`);
    }
  });
  Object.assign(o, loopbackUrl(o.url, 'this flood'));
  return o;
}

const now = () => performance.now() / 1000;

function pct(xs, p) {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}

const secs = (x) => (Number.isNaN(x) ? '-' : x < 1 ? `${(x * 1000).toFixed(1)} ms` : `${x.toFixed(2)} s`);

async function main() {
  const o = parseArgs(process.argv.slice(2));
  const sockets = new Set();
  const trickles = new Set();
  const st = { opened: 0, closedByServer: 0, errors: 0, open: 0, minOpen: Infinity, maxOpen: 0 };
  let flooding = true;

  // One trickling connection; opens its successor when the server closes it.
  const trickle = (id) => {
    if (!flooding) return;
    const s = net.connect({ host: o.host, port: o.port });
    sockets.add(s);
    trickles.add(s);
    let timer = null;
    let lines = 0;
    s.setNoDelay(true);
    s.on('connect', () => {
      st.opened++;
      st.open++;
      st.maxOpen = Math.max(st.maxOpen, st.open);
      s.write(`GET /health HTTP/1.1\r\nHost: ${o.host}\r\n`);
      timer = setInterval(() => s.write(`X-Trickle-${lines++}: ${id}\r\n`), o.interval * 1000);
    });
    s.on('data', () => {});
    s.on('error', () => { st.errors++; });
    s.on('close', () => {
      clearInterval(timer);
      sockets.delete(s);
      trickles.delete(s);
      if (timer) st.open--;
      if (!flooding) return;
      st.closedByServer++;
      setTimeout(() => trickle(id), 100);
    });
  };

  // One GET /health on a fresh connection; resolves to seconds waited and the status.
  const probes = [];
  const probe = () => {
    const p = { t0: now(), t: null, status: null };
    probes.push(p);
    const s = net.connect({ host: o.host, port: o.port });
    sockets.add(s);
    let got = '';
    s.on('connect', () => s.write(`GET /health HTTP/1.1\r\nHost: ${o.host}\r\nConnection: close\r\n\r\n`));
    s.on('data', (d) => { got += d.toString('latin1'); });
    s.on('error', () => {});
    s.on('close', () => {
      sockets.delete(s);
      const m = got.match(/^HTTP\/1\.[01] (\d{3})/);
      p.status = m ? Number(m[1]) : 0;
      p.t = now() - p.t0;
    });
  };

  const t0 = now();
  for (let i = 0; i < o.connections; i++) trickle(i);
  const sampler = setInterval(() => { if (now() - t0 > o.interval) st.minOpen = Math.min(st.minOpen, st.open); }, 250);
  await new Promise((r) => setTimeout(r, Math.min(2, o.duration / 4) * 1000));
  const prober = setInterval(probe, o.probeEvery * 1000);
  probe();
  await new Promise((r) => setTimeout(r, (o.duration - (now() - t0)) * 1000));
  clearInterval(prober);
  clearInterval(sampler);
  const tFloodEnd = now();
  flooding = false;
  const openAtEnd = st.open;
  // let go of the flood, then give the probes still open a moment to be answered
  for (const s of trickles) s.destroy();
  const until = now() + o.linger;
  while (probes.some((p) => p.t === null) && now() < until) await new Promise((r) => setTimeout(r, 50));
  for (const s of sockets) s.destroy();

  const tEnd = now();
  const answered = probes.filter((p) => p.status >= 100);
  const unanswered = probes.filter((p) => !(p.status >= 100));
  const during = answered.filter((p) => p.t0 + p.t <= tFloodEnd);
  const waits = answered.map((p) => p.t);
  const statuses = {};
  for (const p of answered) statuses[p.status] = (statuses[p.status] ?? 0) + 1;
  console.log(`flood: ${o.connections} connections to ${o.host}:${o.port}, one header line every ${o.interval} s, ` +
    `${o.duration} s`);
  console.log(`  connections opened ${st.opened}, closed by the server ${st.closedByServer}, socket errors ${st.errors}, ` +
    `open at once: max ${st.maxOpen}, min ${st.minOpen === Infinity ? '-' : st.minOpen}, at the end ${openAtEnd}`);
  console.log(`/health probes: ${probes.length} sent, ${answered.length} answered ` +
    `(${during.length} during the flood; status ${JSON.stringify(statuses)}), ${unanswered.length} not answered`);
  console.log(`  answered after: p50 ${secs(pct(waits, 50))}, p90 ${secs(pct(waits, 90))}, ` +
    `max ${secs(waits.length ? Math.max(...waits) : NaN)}`);
  if (unanswered.length) {
    const w = unanswered.map((p) => (p.t !== null ? p.t : tEnd - p.t0));
    console.log(`  not answered: ${unanswered.filter((p) => p.t !== null).length} closed without an answer, ` +
      `${unanswered.filter((p) => p.t === null).length} still waiting when given up; waited up to ${secs(Math.max(...w))}`);
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(2);
});

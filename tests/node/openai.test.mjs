// The official OpenAI Node SDK against a real `blade serve`: if the SDK can use blade
// unchanged (responses, streams, errors mapped to its own classes), so can applications.
// Run by ctest as `node --test`; BLADE_BINARY and BLADE_SHARED_DIR name the binary and
// the shared data directory.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';

let OpenAI;
try {
  ({ default: OpenAI } = await import('openai'));
} catch {
  throw new Error('the openai package is missing: run scripts/install-deps.sh (npm ci in tests/node)');
}

const BINARY = process.env.BLADE_BINARY;
const SHARED = process.env.BLADE_SHARED_DIR;
assert.ok(BINARY && SHARED, 'BLADE_BINARY and BLADE_SHARED_DIR must be set (ctest sets them)');
const KEY = 'node-test-key';

let server;
let exited;
let client;
let dir;

before(async () => {
  const cases = JSON.parse(readFileSync(join(SHARED, 'chat-templates/cases.json'), 'utf8'));
  const chatml = cases.find((c) => c.name === 'teknium/OpenHermes-2.5-Mistral-7B');
  dir = mkdtempSync(join(tmpdir(), 'blade-node-'));
  const templateFile = join(dir, 'chatml.jinja');
  writeFileSync(templateFile, chatml.template);
  server = spawn(BINARY, ['serve', '-m', join(SHARED, 'models/stories260K.gguf'), '--port', '0', '--kv-mem', '64M',
    '-t', '2', '--api-key', KEY, '--chat-template', templateFile, '--alias', 'stories'],
  { stdio: ['ignore', 'pipe', 'inherit'] });
  exited = new Promise((resolve) => server.on('exit', (code, signal) => resolve({ code, signal })));
  const port = await new Promise((resolve, reject) => {
    let found = 0;
    const lines = createInterface({ input: server.stdout });
    lines.on('line', (line) => {
      const m = line.match(/listening on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) found = Number(m[1]);
      if (line.includes('blade serve: ready')) resolve(found);
    });
    server.on('exit', (code) => reject(new Error(`blade serve exited with ${code} before it was ready`)));
  });
  client = new OpenAI({ apiKey: KEY, baseURL: `http://127.0.0.1:${port}/v1`, maxRetries: 0, timeout: 120000 });
});

after(async () => {
  server.kill('SIGTERM');
  const { code, signal } = await exited;
  rmSync(dir, { recursive: true, force: true });
  assert.equal(signal, null);
  assert.equal(code, 0, 'blade serve must drain and exit 0 on SIGTERM');
});

test('models.list names the alias', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, ['stories']);
});

test('completions: greedy text, usage and finish reason', async () => {
  const r = await client.completions.create({ model: 'stories', prompt: 'Once upon a time', max_tokens: 20,
    temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.match(r.id, /^cmpl-/);
  assert.equal(r.model, 'stories');
  assert.equal(r.choices.length, 1);
  assert.ok(r.choices[0].text.length > 0);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 20);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 20);
  assert.equal(typeof r.usage.prompt_tokens_details.cached_tokens, 'number');
});

test('chat completions: an assistant message', async () => {
  const r = await client.chat.completions.create({ model: 'stories260K.gguf', temperature: 0, max_tokens: 12,
    messages: [{ role: 'system', content: 'You tell stories.' }, { role: 'user', content: 'Tell one.' }] });
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
});

test('streaming completions carry the same text as a plain request', async () => {
  const body = { model: 'stories', prompt: 'The little cat', max_tokens: 24, temperature: 0 };
  const plain = await client.completions.create(body);
  const stream = await client.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, plain.choices[0].text);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 24);
});

test('streaming chat: role first, then content, then usage', async () => {
  const stream = await client.chat.completions.create({ model: 'stories', max_tokens: 10, seed: 3, stream: true,
    stream_options: { include_usage: true }, messages: [{ role: 'user', content: 'Hello' }] });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  assert.equal(chunks[0].object, 'chat.completion.chunk');
  const content = chunks.flatMap((c) => c.choices.map((x) => x.delta.content ?? '')).join('');
  assert.equal(typeof content, 'string');
  const last = chunks[chunks.length - 1];
  assert.deepEqual(last.choices, []);
  assert.ok(last.usage.completion_tokens >= 1);
});

test('n = 3 choices, reproducible with a seed', async () => {
  const body = { model: 'stories', prompt: 'Once upon a time', n: 3, max_tokens: 12, seed: 1234, temperature: 1 };
  const a = await client.completions.create(body);
  const b = await client.completions.create(body);
  assert.equal(a.choices.length, 3);
  assert.deepEqual(a.choices.map((c) => c.index), [0, 1, 2]);
  assert.deepEqual(a.choices.map((c) => c.text), b.choices.map((c) => c.text));
  assert.equal(a.usage.completion_tokens, 36);
});

test('stop strings end the text before them', async () => {
  const r = await client.completions.create({ model: 'stories', prompt: 'Once upon a time', max_tokens: 40,
    temperature: 0, stop: ['Lily', 'zzz'] });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.ok(!r.choices[0].text.includes('Lily'));
});

test('logprobs in both APIs', async () => {
  const c = await client.completions.create({ model: 'stories', prompt: 'Once upon a time', max_tokens: 4,
    temperature: 0, logprobs: 2 });
  const lp = c.choices[0].logprobs;
  assert.equal(lp.tokens.length, 4);
  assert.equal(lp.token_logprobs.length, 4);
  assert.equal(lp.text_offset.length, 4);
  assert.ok(Object.keys(lp.top_logprobs[0]).length >= 2);
  const h = await client.chat.completions.create({ model: 'stories', max_tokens: 3, temperature: 0,
    ignore_eos: true, logprobs: true, top_logprobs: 2, messages: [{ role: 'user', content: 'Hi' }] });
  const content = h.choices[0].logprobs.content;
  assert.equal(content.length, 3);
  assert.equal(content[0].top_logprobs.length, 2);
  assert.ok(content[0].logprob <= 0);
});

test('errors arrive as the SDK error classes', async () => {
  await assert.rejects(
    client.completions.create({ model: 'stories', prompt: 'x', temperature: 5 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && /temperature/.test(e.message));
  await assert.rejects(
    client.chat.completions.create({ model: 'stories', messages: [] }),
    (e) => e instanceof OpenAI.BadRequestError && /at least one message/.test(e.message));
  await assert.rejects(
    client.completions.create({ model: 'gpt-9', prompt: 'x' }),
    (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === 'model_not_found');
  const wrongKey = new OpenAI({ apiKey: 'nope', baseURL: client.baseURL, maxRetries: 0 });
  await assert.rejects(
    wrongKey.completions.create({ model: 'stories', prompt: 'x' }),
    (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  await assert.rejects(
    client.completions.create({ model: 'stories', prompt: 'x', max_tokens: 100000 }),
    (e) => e instanceof OpenAI.BadRequestError && /maximum context length is 2048/.test(e.message));
});

test('embeddings.create: unit vectors, the same whether sent alone or in a list, as floats or base64', async () => {
  const one = await client.embeddings.create({ model: 'stories', input: 'Once upon a time' });
  assert.equal(one.object, 'list');
  assert.equal(one.model, 'stories');
  assert.equal(one.data.length, 1);
  assert.equal(one.data[0].object, 'embedding');
  assert.equal(one.data[0].index, 0);
  const v = one.data[0].embedding;
  assert.equal(v.length, 64); // stories260K's width
  assert.ok(Math.abs(v.reduce((s, x) => s + x * x, 0) - 1) < 1e-5);
  assert.ok(one.usage.prompt_tokens > 0);
  assert.equal(one.usage.total_tokens, one.usage.prompt_tokens);

  const many = await client.embeddings.create({ model: 'stories', input: ['A cat sat.', 'Once upon a time', 'Lily'],
    encoding_format: 'float' });
  assert.deepEqual(many.data.map((d) => d.index), [0, 1, 2]);
  assert.deepEqual(many.data[1].embedding, v);
  assert.notDeepEqual(many.data[0].embedding, v);

  // the SDK decodes base64 itself when asked for it
  const b64 = await client.embeddings.create({ model: 'stories', input: 'Once upon a time', encoding_format: 'base64' });
  const raw = b64.data[0].embedding;
  const bytes = typeof raw === 'string' ? Buffer.from(raw, 'base64') : null;
  const floats = bytes ? Array.from(new Float32Array(bytes.buffer, bytes.byteOffset, bytes.length / 4)) : raw;
  assert.deepEqual(floats, v);

  const short = await client.embeddings.create({ model: 'stories', input: [[1, 2, 3]], dimensions: 8 });
  assert.equal(short.data[0].embedding.length, 8);
  assert.ok(Math.abs(short.data[0].embedding.reduce((s, x) => s + x * x, 0) - 1) < 1e-5);

  await assert.rejects(client.embeddings.create({ model: 'stories', input: '' }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === 'input');
  await assert.rejects(client.embeddings.create({ model: 'stories', input: 'x', dimensions: 65 }),
    (e) => e instanceof OpenAI.BadRequestError && /dimensions/.test(e.message));
});

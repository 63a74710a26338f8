// Driven by openai_sdk_e2e_test.sh: the official OpenAI SDK against a running stowage_server.
//   node openai_sdk_e2e_test.mjs <folder holding node_modules/openai>
// Environment: STOWAGE_BASE_URL (http://host:port/v1, or https:// with STOWAGE_MODE=tls), STOWAGE_API_KEY.
// Prints one line per check and "N passed, N failed"; exits 1 when any check failed.
import { readFileSync } from 'node:fs';
import zlib from 'node:zlib';
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.argv[2], 'package.json'));
const sdk = require('openai');
const OpenAI = sdk.OpenAI ?? sdk.default ?? sdk;
const errors = {
  BadRequestError: sdk.BadRequestError ?? OpenAI.BadRequestError,
  AuthenticationError: sdk.AuthenticationError ?? OpenAI.AuthenticationError,
  NotFoundError: sdk.NotFoundError ?? OpenAI.NotFoundError,
  RateLimitError: sdk.RateLimitError ?? OpenAI.RateLimitError,
};
const sdkVersion = JSON.parse(
  readFileSync(path.join(process.argv[2], 'node_modules', 'openai', 'package.json'), 'utf8')).version;

const baseURL = process.env.STOWAGE_BASE_URL;
const apiKey = process.env.STOWAGE_API_KEY;
// maxRetries 0: the SDK retries 429 and 5xx by default, which would hide what the server answered.
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30000 });

let passed = 0;
let failed = 0;
async function check(name, body) {
  try {
    await body();
    passed++;
    console.log(`ok   ${name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${name}: ${e && e.stack ? e.stack : e}`);
  }
}
function assert(condition, message) {
  if (!condition) throw new Error(message);
}

// Width and height from a PNG's IHDR chunk, after checking the signature.
function pngSize(png) {
  const signature = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  assert(png.length > 24 && png.subarray(0, 8).equals(signature), 'not a PNG (signature)');
  assert(png.subarray(12, 16).toString('latin1') === 'IHDR', 'no IHDR chunk first');
  return { width: png.readUInt32BE(16), height: png.readUInt32BE(20) };
}

// A flat gray PNG (8-bit gray, one value) of width x height: a mask for images.edit.
function grayPng(width, height, value) {
  const crcTable = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc32 = (bytes) => {
    let c = 0xffffffff;
    for (const b of bytes) c = crcTable[(c ^ b) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  };
  const chunk = (type, data) => {
    const length = Buffer.alloc(4);
    length.writeUInt32BE(data.length);
    const body = Buffer.concat([Buffer.from(type, 'latin1'), data]);
    const crc = Buffer.alloc(4);
    crc.writeUInt32BE(crc32(body));
    return Buffer.concat([length, body, crc]);
  };
  const header = Buffer.alloc(13);
  header.writeUInt32BE(width, 0);
  header.writeUInt32BE(height, 4);
  header[8] = 8;  // Bit depth; color type 0 (gray), compression, filter, interlace 0.
  const rows = Buffer.alloc((width + 1) * height, value);
  for (let y = 0; y < height; y++) rows[y * (width + 1)] = 0;  // Filter byte: none.
  return Buffer.concat([Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]), chunk('IHDR', header),
                        chunk('IDAT', zlib.deflateSync(rows)), chunk('IEND', Buffer.alloc(0))]);
}

// Runs `call`, which must fail with the SDK's `errorClass` and HTTP `status`; returns the error.
async function expectError(call, errorClass, status) {
  let caught = null;
  try {
    await call();
  } catch (e) {
    caught = e;
  }
  assert(caught !== null, `expected ${errorClass.name}, but the call succeeded`);
  assert(caught instanceof errorClass, `expected ${errorClass.name}, got ${caught.constructor.name}: ${caught.message}`);
  assert(caught.status === status, `expected HTTP ${status}, got ${caught.status}`);
  return caught;
}

console.log(`openai SDK ${sdkVersion} on Node.js ${process.version} against ${baseURL}`);

// STOWAGE_MODE=tls: the server speaks HTTPS (its certificate from a CA the shell script made and
// handed to Node through NODE_EXTRA_CA_CERTS).
if (process.env.STOWAGE_MODE === 'tls') {
  await check('over HTTPS: images.generate returns a PNG and models.list the pipelines', async () => {
    assert(baseURL.startsWith('https://'), `not an https URL: ${baseURL}`);
    const result = await client.images.generate({ prompt: 'over tls', size: '64x64', num_inference_steps: 2 });
    assert(pngSize(Buffer.from(result.data[0].b64_json, 'base64')).width === 64, 'wrong width');
    const models = await client.models.list();
    assert(models.data.some((m) => m.id === 'zimage-tiny'), 'zimage-tiny not listed');
  });
  await check('over HTTPS: a wrong API key is AuthenticationError', async () => {
    const wrong = new OpenAI({ baseURL, apiKey: `${apiKey}x`, maxRetries: 0 });
    await expectError(() => wrong.models.list(), errors.AuthenticationError, 401);
  });
  await check('plain HTTP to the HTTPS port is a connection error, never an answer', async () => {
    const plain = new OpenAI({ baseURL: baseURL.replace('https://', 'http://'), apiKey, maxRetries: 0, timeout: 10000 });
    let caught = null;
    try {
      await plain.models.list();
    } catch (e) {
      caught = e;
    }
    const APIConnectionError = sdk.APIConnectionError ?? OpenAI.APIConnectionError;
    assert(caught instanceof APIConnectionError, `expected APIConnectionError, got ${caught && caught.constructor.name}`);
  });
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed === 0 && passed > 0 ? 0 : 1);
}

await check('images.generate returns n base64 PNGs of the requested size', async () => {
  const result = await client.images.generate({
    model: 'zimage-tiny',
    prompt: 'a red circle at the top left on a blue background',
    n: 2,
    size: '64x64',
    response_format: 'b64_json',
    // Stowage's own fields travel in the same body.
    seed: 7,
    num_inference_steps: 2,
    negative_prompt: 'blurry',
  });
  assert(Array.isArray(result.data) && result.data.length === 2, `expected 2 images, got ${JSON.stringify(result.data?.length)}`);
  assert(typeof result.created === 'number' && result.created > 1.6e9, `bad created: ${result.created}`);
  const pngs = result.data.map((image) => Buffer.from(image.b64_json, 'base64'));
  for (const png of pngs) {
    const { width, height } = pngSize(png);
    assert(width === 64 && height === 64, `PNG is ${width}x${height}, not 64x64`);
  }
  assert(!pngs[0].equals(pngs[1]), 'two images of different seeds are identical');
  assert(result.data[0].seed === 7 && result.data[1].seed === 8, `seeds ${result.data.map((d) => d.seed)}`);
  assert(result.data[0].stats && result.data[0].stats.device, 'no per-request stats in the reply');
});

await check('the same seed draws the same PNG (withResponse exposes the stats headers)', async () => {
  const request = { prompt: 'a green square', size: '64x64', seed: 11, num_inference_steps: 2 };
  const { data: first, response } = await client.images.generate(request).withResponse();
  const second = await client.images.generate(request);
  assert(first.data[0].b64_json === second.data[0].b64_json, 'same seed, different image');
  assert(response.headers.get('x-stowage-seed') === '11', `x-stowage-seed: ${response.headers.get('x-stowage-seed')}`);
  assert(Number(response.headers.get('x-stowage-peak-device-memory-bytes')) > 0, 'no peak device memory header');
});

await check('models.list names every pipeline; models.retrieve finds one', async () => {
  const ids = [];
  for await (const model of client.models.list()) ids.push(model.id);
  assert(JSON.stringify(ids) === JSON.stringify(['zimage-tiny', 'tiny']), `models: ${JSON.stringify(ids)}`);
  const model = await client.models.retrieve('tiny');
  assert(model.id === 'tiny' && model.object === 'model', JSON.stringify(model));
});

await check('a size off the grid is BadRequestError naming size', async () => {
  const e = await expectError(() => client.images.generate({ prompt: 'x', size: '65x64' }), errors.BadRequestError, 400);
  assert(e.param === 'size', `param ${e.param}`);
  assert(e.type === 'invalid_request_error', `type ${e.type}`);
});

await check('response_format url is BadRequestError', async () => {
  const e = await expectError(() => client.images.generate({ prompt: 'x', response_format: 'url' }),
                              errors.BadRequestError, 400);
  assert(e.param === 'response_format' && /b64_json/.test(e.message), e.message);
});

await check('n out of range and wrong types are BadRequestError', async () => {
  await expectError(() => client.images.generate({ prompt: 'x', n: 11 }), errors.BadRequestError, 400);
  await expectError(() => client.images.generate({ prompt: 'x', n: 0 }), errors.BadRequestError, 400);
  await expectError(() => client.images.generate({ prompt: 42 }), errors.BadRequestError, 400);
  await expectError(() => client.images.generate({ prompt: 'x', size: 'big' }), errors.BadRequestError, 400);
});

await check('an unknown model is NotFoundError with code model_not_found', async () => {
  const e = await expectError(() => client.images.generate({ model: 'dall-e-3', prompt: 'x' }), errors.NotFoundError, 404);
  assert(e.code === 'model_not_found', `code ${e.code}`);
  await expectError(() => client.models.retrieve('dall-e-3'), errors.NotFoundError, 404);
});

await check('a wrong API key is AuthenticationError', async () => {
  const wrong = new OpenAI({ baseURL, apiKey: `${apiKey}x`, maxRetries: 0 });
  const e = await expectError(() => wrong.images.generate({ prompt: 'x' }), errors.AuthenticationError, 401);
  assert(e.code === 'invalid_api_key', `code ${e.code}`);
  await expectError(() => wrong.models.list(), errors.AuthenticationError, 401);
});

await check('a full queue is RateLimitError with code queue_full', async () => {
  // One slow request running (about 3 s), one waiting on the queue of one, and the next refused.
  const slow = (steps) => ({ model: 'tiny', prompt: 'slow', size: '64x64', num_inference_steps: steps, seed: 1 });
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const running = client.images.generate(slow(30));
  await sleep(400);
  const waiting = client.images.generate(slow(2));
  await sleep(400);
  const e = await expectError(() => client.images.generate(slow(2)), errors.RateLimitError, 429);
  assert(e.code === 'queue_full', `code ${e.code}`);
  assert((await running).data.length === 1 && (await waiting).data.length === 1, 'the accepted requests failed');
});

await check('n images beyond the queue depth wait for each other instead of failing', async () => {
  const result = await client.images.generate({ model: 'tiny', prompt: 'x', n: 3, size: '64x64', num_inference_steps: 2 });
  assert(result.data.length === 3, `expected 3 images, got ${result.data.length}`);
});

await check('stream: true yields progress, partial images and then the image (server-sent events)', async () => {
  const stream = await client.images.generate({
    model: 'zimage-tiny', prompt: 'a streamed square', size: '64x64', num_inference_steps: 4, seed: 3,
    stream: true, partial_images: 2,
  });
  const types = [];
  let completed = null;
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === 'image_generation.partial_image') {
      assert(pngSize(Buffer.from(event.b64_json, 'base64')).width === 64, 'a preview of the wrong size');
    }
    if (event.type === 'image_generation.completed') completed = event;
  }
  assert(types.filter((t) => t === 'stowage.progress').length >= 4, `progress events: ${types.join(',')}`);
  assert(types.filter((t) => t === 'image_generation.partial_image').length === 2, `partial images: ${types.join(',')}`);
  assert(types[types.length - 1] === 'image_generation.completed', `last event: ${types[types.length - 1]}`);
  const png = Buffer.from(completed.b64_json, 'base64');
  assert(pngSize(png).width === 64 && completed.seed === 3, 'wrong completed image');
  // The streamed image is the one an unstreamed request of the same seed returns.
  const plain = await client.images.generate({
    model: 'zimage-tiny', prompt: 'a streamed square', size: '64x64', num_inference_steps: 4, seed: 3,
  });
  assert(Buffer.from(plain.data[0].b64_json, 'base64').equals(png), 'streamed and unstreamed images differ');
});

await check('images.edit: image to image from a PNG file, with Stowage\'s strength and seed', async () => {
  const toFile = sdk.toFile ?? OpenAI.toFile;
  // The input: an image the server drew (64x64 PNG).
  const drawn = await client.images.generate({ prompt: 'a red circle', size: '64x64', seed: 1, num_inference_steps: 2 });
  const input = Buffer.from(drawn.data[0].b64_json, 'base64');
  const edit = async (fields) => client.images.edit({
    model: 'zimage-tiny', image: await toFile(input, 'input.png', { type: 'image/png' }), prompt: 'a blue square',
    num_inference_steps: 4, seed: 5, ...fields,
  });
  const a = await edit({ strength: 0.5 });
  const b = await edit({ strength: 0.5 });
  const c = await edit({ strength: 1.0 });
  const png = Buffer.from(a.data[0].b64_json, 'base64');
  const { width, height } = pngSize(png);
  assert(width === 64 && height === 64, `edited PNG is ${width}x${height}`);
  assert(png.equals(Buffer.from(b.data[0].b64_json, 'base64')), 'same seed and strength, different image');
  assert(!png.equals(Buffer.from(c.data[0].b64_json, 'base64')), 'the strength changed nothing');
});

await check('images.edit with a mask: a black mask keeps the whole image whatever the prompt', async () => {
  const toFile = sdk.toFile ?? OpenAI.toFile;
  const drawn = await client.images.generate({ prompt: 'a green circle', size: '64x64', seed: 2, num_inference_steps: 2 });
  const input = Buffer.from(drawn.data[0].b64_json, 'base64');
  const keep = async (prompt) => client.images.edit({
    model: 'zimage-tiny', prompt, seed: 5, num_inference_steps: 3,
    image: await toFile(input, 'input.png', { type: 'image/png' }),
    mask: await toFile(grayPng(64, 64, 0), 'mask.png', { type: 'image/png' }),
  });
  const [x, y] = [await keep('a cat'), await keep('a lighthouse')];
  assert(x.data[0].b64_json === y.data[0].b64_json, 'a keep-everything mask let the prompt change the image');
  const e = await expectError(async () => client.images.edit({
    model: 'zimage-tiny', prompt: 'x', image: await toFile(input, 'input.png', { type: 'image/png' }),
    mask: await toFile(grayPng(32, 32, 255), 'mask.png', { type: 'image/png' }),
  }), errors.BadRequestError, 400);
  assert(/mask is 32x32; the image is 64x64/.test(e.message), e.message);
});

await check('images.edit stream: true yields image_edit events', async () => {
  const toFile = sdk.toFile ?? OpenAI.toFile;
  const drawn = await client.images.generate({ prompt: 'a yellow circle', size: '64x64', seed: 3, num_inference_steps: 2 });
  const stream = await client.images.edit({
    model: 'zimage-tiny', prompt: 'a streamed edit', seed: 4, num_inference_steps: 4, strength: 1.0,
    image: await toFile(Buffer.from(drawn.data[0].b64_json, 'base64'), 'input.png', { type: 'image/png' }),
    stream: true, partial_images: 1,
  });
  const types = [];
  for await (const event of stream) types.push(event.type);
  assert(types.includes('image_edit.partial_image'), `events: ${types.join(',')}`);
  assert(types[types.length - 1] === 'image_edit.completed', `last event: ${types[types.length - 1]}`);
});

await check('images.edit on a pipeline that takes no images is BadRequestError', async () => {
  const toFile = sdk.toFile ?? OpenAI.toFile;
  const e = await expectError(async () => client.images.edit({
    model: 'tiny', prompt: 'x', image: await toFile(grayPng(64, 64, 9), 'input.png', { type: 'image/png' }),
  }), errors.BadRequestError, 400);
  assert(/takes no input image/.test(e.message), e.message);
});

await check('after all of that, generation still works', async () => {
  const result = await client.images.generate({ prompt: 'still alive', size: '64x64', num_inference_steps: 2 });
  pngSize(Buffer.from(result.data[0].b64_json, 'base64'));
});

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed === 0 && passed > 0 ? 0 : 1);

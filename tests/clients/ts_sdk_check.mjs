// The TypeScript SDK (@anthropic-ai/sdk, pinned in package.json) against a Cachepoint
// gateway: create, stream, countTokens and two typed errors, printed as one JSON object.
// Env: CACHEPOINT_BASE_URL, CACHEPOINT_API_KEY, CACHEPOINT_MODEL, and
// CACHEPOINT_NODE_MODULES (where `make clients` installed the SDK: this file is tracked
// beside the lock file, its node_modules lives in the ignored .tools/node).
import path from "node:path";
import { pathToFileURL } from "node:url";

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const sdkEntry = path.join(env("CACHEPOINT_NODE_MODULES"), "@anthropic-ai", "sdk", "index.mjs");
const { default: Anthropic, NotFoundError, BadRequestError } = await import(
  pathToFileURL(sdkEntry).href
);
const model = env("CACHEPOINT_MODEL");
const client = new Anthropic({
  baseURL: env("CACHEPOINT_BASE_URL"),
  apiKey: env("CACHEPOINT_API_KEY"),
  maxRetries: 0,
});
const messages = [{ role: "user", content: "Say hi." }];
const out = { sdk_version: (await import(pathToFileURL(
  path.join(env("CACHEPOINT_NODE_MODULES"), "@anthropic-ai", "sdk", "version.mjs")).href)).VERSION };

const created = await client.messages.create({ model, max_tokens: 8, messages });
out.create = {
  type: created.type,
  role: created.role,
  model: created.model,
  stop_reason: created.stop_reason,
  text: created.content.map((b) => (b.type === "text" ? b.text : "")).join(""),
  usage: created.usage,
};

const stream = client.messages.stream({ model, max_tokens: 8, messages });
const events = [];
stream.on("streamEvent", (event) => events.push(event.type));
const final = await stream.finalMessage();
out.stream = {
  events,
  stop_reason: final.stop_reason,
  text: final.content.map((b) => (b.type === "text" ? b.text : "")).join(""),
  usage: final.usage,
};

const counted = await client.messages.countTokens({ model, messages });
out.count_tokens = counted;

// Two typed errors: an unknown model (404) and a bad field (400).
const failure = async (params) => {
  try {
    await client.messages.create(params);
    return null;
  } catch (err) {
    return {
      class: err.constructor.name,
      not_found: err instanceof NotFoundError,
      bad_request: err instanceof BadRequestError,
      status: err.status,
      type: err.error?.error?.type ?? null,
      message: err.error?.error?.message ?? null,
      request_id: err.requestID ?? null,
    };
  }
};
out.not_found = await failure({ model: "no-such-model", max_tokens: 8, messages });
out.bad_request = await failure({ model, max_tokens: 0, messages });
process.stdout.write(JSON.stringify(out) + "\n");

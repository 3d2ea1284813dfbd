// A web backend's use of the automesh public gateway over gRPC:
//
//   1. create a daily automation from the web surface (placement: cloud);
//   2. run it now with an idempotency key, and show that the same key again
//      returns the same run;
//   3. follow the run's events live (Runs.WatchRun) until the stream ends;
//   4. read the run back (Runs.GetRun) and print its receipt.
//
// Configuration (environment):
//   AUTOMESH_GATEWAY    host:port of the public gateway, plaintext gRPC (required)
//   AUTOMESH_TOKEN      a bearer JWT for the caller (required); `automesh dev`
//                       writes one to <data dir>/dev-token
//   AUTOMESH_MODEL      a catalogue model id (default: openai/gpt-4.1-mini)
//   AUTOMESH_PROTO_DIR  where automesh/v1/*.proto live (default: the repo's proto/)
//
// Exit status: 0 when the run ended succeeded with a receipt; 1 when a call
// failed (its gRPC status code and message are printed) or the run ended
// otherwise; 2 when the configuration is missing.

import { randomUUID } from "node:crypto";
import path from "node:path";

import {
  Gateway,
  RpcError,
  TERMINAL_STATES,
  type Receipt,
  type Run,
  type RunEvent,
  type RunState,
  type Timestamp,
} from "./automesh";

/** Deadline of each unary call. */
const UNARY_TIMEOUT_MS = 10_000;
/** Deadline of the whole WatchRun stream. */
const WATCH_TIMEOUT_MS = 90_000;

class ConfigError extends Error {}

function env(name: string, fallback?: string): string {
  const value = process.env[name]?.trim() || fallback;
  if (!value) throw new ConfigError(`${name} is not set`);
  return value;
}

/** "RUN_STATE_SUCCEEDED" → "succeeded". */
function short(state: string, prefix: string): string {
  return state.startsWith(prefix) ? state.slice(prefix.length).toLowerCase() : state;
}
const runState = (s: RunState): string => short(s, "RUN_STATE_");

function iso(t: Timestamp | null): string {
  if (!t) return "-";
  return new Date(Number(t.seconds) * 1000 + Math.floor(t.nanos / 1e6)).toISOString();
}

function seconds(d: Timestamp | null): string {
  return d ? `${(Number(d.seconds) + d.nanos / 1e9).toFixed(3)} s` : "-";
}

function clip(text: string, max = 100): string {
  const one = text.replace(/\s+/g, " ").trim();
  return one.length > max ? `${one.slice(0, max - 1)}…` : one;
}

function describe(event: RunEvent): string {
  switch (event.payload) {
    case "status_change": {
      const s = event.status_change;
      return `status ${runState(s.state)}${s.error_code ? ` (${s.error_code}: ${clip(s.message)})` : ""}`;
    }
    case "assistant_text":
      return `assistant: ${clip(event.assistant_text.text)}`;
    case "tool_call":
      return `tool call ${event.tool_call.tool} ${clip(event.tool_call.input_json)}`;
    case "tool_result":
      return `tool result ${event.tool_result.tool}${event.tool_result.is_error ? " (error)" : ""}: ${clip(event.tool_result.output)}`;
    case "permission_prompt": {
      const p = event.permission_prompt;
      return `permission ${p.permission} [${p.patterns.join(", ")}] → ${p.reply || "pending"}`;
    }
    case "usage":
      return `usage: tokens in/out ${event.usage.input_tokens}/${event.usage.output_tokens}, cost ${event.usage.cost_micros} µ`;
    case undefined:
      return "(an event of a kind this client does not know)";
  }
}

function printReceipt(run: Run, receipt: Receipt): void {
  const usage = receipt.usage;
  const line = (label: string, value: string) => console.log(`  ${label.padEnd(14)}${value}`);
  console.log(`receipt of run ${run.id}`);
  line("outcome", runState(receipt.outcome));
  if (receipt.error_code) line("error", `${receipt.error_code}: ${receipt.error_message}`);
  line("engine", receipt.engine);
  line("model", `${receipt.model} (asked of the provider as ${receipt.provider_model || "-"})`);
  line("tokens", usage ? `in ${usage.input_tokens}, out ${usage.output_tokens}` : "-");
  line("cost_micros", usage ? `${usage.cost_micros} (${(Number(usage.cost_micros) / 1e6).toFixed(6)} in the billing currency)` : "-");
  line(
    "price",
    receipt.price
      ? `${receipt.price.input_micros_per_million_tokens} / ${receipt.price.output_micros_per_million_tokens} µ per million input / output tokens`
      : "none (unpriced model: cost 0 means unknown, not free)",
  );
  line("queued", seconds(receipt.queued_duration));
  line("execution", seconds(receipt.execution_duration));
  line("trace id", run.trace_id || "-");
}

async function main(): Promise<number> {
  const gateway = new Gateway({
    address: env("AUTOMESH_GATEWAY").replace(/^http:\/\//, ""),
    token: env("AUTOMESH_TOKEN"),
    protoDir: env("AUTOMESH_PROTO_DIR", path.resolve(__dirname, "..", "..", "..", "proto")),
    unaryTimeoutMs: UNARY_TIMEOUT_MS,
  });
  const model = env("AUTOMESH_MODEL", "openai/gpt-4.1-mini");
  try {
    // 1. A daily automation at 09:30 Paris time, created from the web.
    const automation = await gateway.createAutomation({
      surface: "SURFACE_WEB",
      automation: {
        name: `typescript example ${new Date().toISOString()}`,
        prompt: "What is the weather forecast in Paris?",
        model,
        schedule: { daily: { time_of_day: { hours: 9, minutes: 30 }, time_zone: "Europe/Paris" } },
      },
    });
    console.log(`created automation ${automation.id}`);
    console.log(`  placement ${short(automation.placement, "PLACEMENT_")}, state ${short(automation.state, "AUTOMATION_STATE_")}, model ${automation.model}`);
    console.log(`  next run ${iso(automation.next_run_time)}`);

    // 2. Run it now. A backend derives the key from the user's request (a
    //    form submission id, say), so that a retried request cannot start a
    //    second run.
    const idempotencyKey = `typescript-example-${randomUUID()}`;
    const run = await gateway.runAutomationNow({ id: automation.id, idempotency_key: idempotencyKey });
    console.log(`started run ${run.id} (${runState(run.state)}, trace ${run.trace_id || "-"})`);
    const again = await gateway.runAutomationNow({ id: automation.id, idempotency_key: idempotencyKey });
    if (again.id !== run.id) {
      throw new Error(`the same idempotency key started a second run: ${run.id}, then ${again.id}`);
    }
    console.log(`  the same idempotency key again returned the same run ${again.id}`);

    // 3. Follow it live from the start until the server ends the stream.
    let state: RunState = run.state;
    let lastSequence = "0";
    const stream = gateway.watchRun(run.id, lastSequence, WATCH_TIMEOUT_MS);
    for await (const update of stream) {
      if (update.update === "run") {
        state = update.run.state;
        console.log(`  [run] ${runState(state)}`);
      } else {
        const event = update.event;
        lastSequence = event.sequence;
        if (event.payload === "status_change") state = event.status_change.state;
        console.log(`  ${event.sequence.padStart(4)}  ${describe(event)}`);
      }
    }
    console.log(`the stream ended after event ${lastSequence}, with the run ${runState(state)}`);

    // 4. Read the run back: terminal runs carry their receipt.
    const final = await gateway.getRun(run.id);
    if (!TERMINAL_STATES.has(final.state)) {
      console.error(`error: the run is ${runState(final.state)} after its stream ended, not terminal`);
      return 1;
    }
    if (!final.receipt) {
      console.error(`error: the run is ${runState(final.state)} but has no receipt`);
      return 1;
    }
    printReceipt(final, final.receipt);
    if (final.state !== "RUN_STATE_SUCCEEDED") {
      console.error(`error: the run ended ${runState(final.state)}: ${final.error_code} ${final.error_message}`);
      return 1;
    }
    return 0;
  } finally {
    gateway.close();
  }
}

main().then(
  (code) => {
    process.exitCode = code;
  },
  (e: unknown) => {
    if (e instanceof ConfigError) {
      console.error(`error: ${e.message} (see the top of src/main.ts)`);
      process.exitCode = 2;
    } else if (e instanceof RpcError) {
      console.error(`error: ${e.message}`);
      process.exitCode = 1;
    } else {
      console.error(`error: ${e instanceof Error ? e.message : String(e)}`);
      process.exitCode = 1;
    }
  },
);

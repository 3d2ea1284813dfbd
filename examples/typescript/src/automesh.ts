// A small typed client for the automesh public gateway (automesh.v1), as a
// web backend would keep one: the protos are loaded at run time by
// @grpc/proto-loader, and the shapes this example touches are described by
// the interfaces below (field names exactly as in proto/automesh/v1/*.proto,
// thanks to `keepCase`).
//
// Decoding options (see `LOADER_OPTIONS`): int64 fields arrive as decimal
// strings, enums as their names, unset message fields as null, and each
// oneof names its set member in a virtual field (`kind`, `payload`,
// `update`).

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

// ---- the shapes (a subset of automesh.v1) ----

/** An int64 as the loader decodes it (`longs: String`). */
export type Int64 = string;

/** google.protobuf.Timestamp / google.protobuf.Duration, decoded. */
export interface Timestamp {
  seconds: Int64;
  nanos: number;
}
export type Duration = Timestamp;

export type Surface = "SURFACE_UNSPECIFIED" | "SURFACE_DESKTOP" | "SURFACE_WEB" | "SURFACE_CLOUD_CHAT";
export type Placement = "PLACEMENT_UNSPECIFIED" | "PLACEMENT_DESKTOP" | "PLACEMENT_CLOUD";
export type AutomationState =
  | "AUTOMATION_STATE_UNSPECIFIED"
  | "AUTOMATION_STATE_ACTIVE"
  | "AUTOMATION_STATE_INACTIVE"
  | "AUTOMATION_STATE_NEEDS_ATTENTION"
  | "AUTOMATION_STATE_ARCHIVED";
export type RunState =
  | "RUN_STATE_UNSPECIFIED"
  | "RUN_STATE_PENDING"
  | "RUN_STATE_WAKING"
  | "RUN_STATE_ADMITTED"
  | "RUN_STATE_RUNNING"
  | "RUN_STATE_SUCCEEDED"
  | "RUN_STATE_FAILED"
  | "RUN_STATE_TIMED_OUT"
  | "RUN_STATE_CANCELLED"
  | "RUN_STATE_SKIPPED"
  | "RUN_STATE_MISSED";
export type RunTrigger = "RUN_TRIGGER_UNSPECIFIED" | "RUN_TRIGGER_SCHEDULE" | "RUN_TRIGGER_MANUAL";

/** The states a run never leaves. */
export const TERMINAL_STATES: ReadonlySet<RunState> = new Set<RunState>([
  "RUN_STATE_SUCCEEDED",
  "RUN_STATE_FAILED",
  "RUN_STATE_TIMED_OUT",
  "RUN_STATE_CANCELLED",
  "RUN_STATE_SKIPPED",
  "RUN_STATE_MISSED",
]);

export interface TimeOfDay {
  hours: number;
  minutes: number;
}

export interface DailySchedule {
  time_of_day: TimeOfDay;
  /** An IANA time zone, such as "Europe/Paris". */
  time_zone: string;
}

/** A schedule as this example sends it: daily only (once and weekly exist too). */
export interface DailyScheduleInput {
  daily: DailySchedule;
}

/** A schedule as the gateway returns it: `kind` names the set member. */
export type Schedule =
  | { kind: "daily"; daily: DailySchedule }
  | { kind: "once"; once: { at: Timestamp | null } }
  | { kind: "weekly"; weekly: { days: string[]; time_of_day: TimeOfDay | null; time_zone: string } };

/** What a caller sets when creating an automation (the rest is output only). */
export interface NewAutomation {
  name: string;
  prompt: string;
  /** A model id from the mesh's catalogue, such as "openai/gpt-4.1-mini". */
  model: string;
  schedule: DailyScheduleInput;
}

export interface Automation {
  id: string;
  organization_id: string;
  owner_id: string;
  name: string;
  prompt: string;
  model: string;
  placement: Placement;
  schedule: Schedule | null;
  state: AutomationState;
  etag: string;
  next_run_time: Timestamp | null;
  create_time: Timestamp | null;
  surface: Surface;
}

export interface CreateAutomationRequest {
  automation: NewAutomation;
  surface: Surface;
}
export interface CreateAutomationResponse {
  automation: Automation | null;
}

export interface RunAutomationNowRequest {
  id: string;
  /** 1..=200 characters; the same key returns the same run. */
  idempotency_key: string;
}
export interface RunAutomationNowResponse {
  run: Run | null;
}

export interface Usage {
  input_tokens: Int64;
  output_tokens: Int64;
  /** Millionths of the billing currency unit. */
  cost_micros: Int64;
}

export interface Price {
  input_micros_per_million_tokens: Int64;
  output_micros_per_million_tokens: Int64;
}

export interface Receipt {
  outcome: RunState;
  error_code: string;
  error_message: string;
  placement: Placement;
  engine: string;
  queued_duration: Duration | null;
  execution_duration: Duration | null;
  usage: Usage | null;
  create_time: Timestamp | null;
  /** The catalogue model the run ran as and was priced by. */
  model: string;
  /** The name the provider was asked for ("automesh-demo" under `automesh dev`'s demo model). */
  provider_model: string;
  /** Unset when the model has no price (then cost is 0: unpriced, not free). */
  price: Price | null;
}

export interface Run {
  id: string;
  automation_id: string;
  placement: Placement;
  trigger: RunTrigger;
  state: RunState;
  error_code: string;
  error_message: string;
  deadline_time: Timestamp | null;
  create_time: Timestamp | null;
  /** Set once the run is terminal. */
  receipt: Receipt | null;
  trace_id: string;
}

export interface AssistantText {
  text: string;
}
export interface ToolCall {
  call_id: string;
  tool: string;
  input_json: string;
}
export interface ToolResult {
  call_id: string;
  tool: string;
  output: string;
  is_error: boolean;
}
export interface PermissionPrompt {
  permission_id: string;
  permission: string;
  patterns: string[];
  reply: string;
}
export interface StatusChange {
  state: RunState;
  error_code: string;
  message: string;
}

/** What a run event carries; `payload` is absent for a kind this proto does not know. */
export type RunEventPayload =
  | { payload: "assistant_text"; assistant_text: AssistantText }
  | { payload: "tool_call"; tool_call: ToolCall }
  | { payload: "tool_result"; tool_result: ToolResult }
  | { payload: "permission_prompt"; permission_prompt: PermissionPrompt }
  | { payload: "usage"; usage: Usage }
  | { payload: "status_change"; status_change: StatusChange }
  | { payload?: undefined };

export type RunEvent = {
  run_id: string;
  /** Strictly increasing per run, starting at 1. */
  sequence: Int64;
  event_id: string;
  create_time: Timestamp | null;
} & RunEventPayload;

export interface WatchRunRequest {
  run_id: string;
  /** Resume after this sequence ("0" = from the start). */
  after_sequence: Int64;
}
/** One message of the WatchRun stream: the next event, or the run as it is now. */
export type WatchRunResponse = { update: "event"; event: RunEvent } | { update: "run"; run: Run };

export interface GetRunRequest {
  id: string;
}
export interface GetRunResponse {
  run: Run | null;
}

// ---- loading the protos ----

export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

const PROTO_FILES = ["automesh/v1/automations.proto", "automesh/v1/runs.proto", "automesh/v1/placement.proto"];

/** One method of a service: its path and its (de)serialisers. */
export interface Rpc<Req, Res> {
  /** "Service.Method", for messages. */
  name: string;
  path: string;
  serialize: (request: Req) => Buffer;
  deserialize: (bytes: Buffer) => Res;
}

function isService(def: protoLoader.AnyDefinition | undefined): def is protoLoader.ServiceDefinition {
  // Message and enum definitions carry a `format`; services are maps of methods.
  return def !== undefined && !("format" in def);
}

/**
 * Looks a method up in the loaded definitions and checks its streaming kind.
 * The response type is this file's description of the proto message: the
 * one place where the loader's untyped output meets the interfaces above.
 */
function rpc<Req extends object, Res>(
  defs: protoLoader.PackageDefinition,
  service: string,
  method: string,
  serverStream: boolean,
): Rpc<Req, Res> {
  const svc = defs[`automesh.v1.${service}`];
  if (!isService(svc)) throw new Error(`automesh.v1.${service} is not a service in the loaded protos`);
  const m = svc[method];
  if (m === undefined) throw new Error(`automesh.v1.${service} has no method ${method}`);
  if (m.requestStream || m.responseStream !== serverStream) {
    throw new Error(`automesh.v1.${service}.${method} is not ${serverStream ? "server-streaming" : "unary"}`);
  }
  return {
    name: `${service}.${method}`,
    path: m.path,
    serialize: (request: Req) => m.requestSerialize(request),
    deserialize: (bytes: Buffer) => m.responseDeserialize(bytes) as Res,
  };
}

/** The methods this example calls. */
export interface Methods {
  createAutomation: Rpc<CreateAutomationRequest, CreateAutomationResponse>;
  runAutomationNow: Rpc<RunAutomationNowRequest, RunAutomationNowResponse>;
  getRun: Rpc<GetRunRequest, GetRunResponse>;
  watchRun: Rpc<WatchRunRequest, WatchRunResponse>;
}

/** Loads automesh.v1 from `protoDir` (the repo's `proto/`). */
export function loadMethods(protoDir: string): Methods {
  const defs = protoLoader.loadSync(PROTO_FILES, { ...LOADER_OPTIONS, includeDirs: [protoDir] });
  return {
    createAutomation: rpc(defs, "Automations", "CreateAutomation", false),
    runAutomationNow: rpc(defs, "Automations", "RunAutomationNow", false),
    getRun: rpc(defs, "Runs", "GetRun", false),
    watchRun: rpc(defs, "Runs", "WatchRun", true),
  };
}

// ---- calling ----

/** A failed call: which method, and the gRPC status it ended with. */
export class RpcError extends Error {
  constructor(
    readonly method: string,
    readonly code: grpc.status,
    readonly details: string,
  ) {
    super(`${method} failed: ${grpc.status[code] ?? "UNKNOWN_CODE"} (code ${code}): ${details}`);
    this.name = "RpcError";
  }
}

function isServiceError(e: unknown): e is grpc.ServiceError {
  return e instanceof Error && "code" in e && typeof e.code === "number" && "details" in e;
}

function rpcError(method: string, e: unknown): Error {
  return isServiceError(e) ? new RpcError(method, e.code, e.details) : e instanceof Error ? e : new Error(String(e));
}

export interface GatewayOptions {
  /** host:port of the public gateway (plaintext gRPC). */
  address: string;
  /** A bearer JWT, sent as `authorization: Bearer <token>` on every call. */
  token: string;
  protoDir: string;
  /** Deadline of each unary call. */
  unaryTimeoutMs: number;
}

/** The public gateway: one channel, both services, a bearer token on every call. */
export class Gateway {
  private readonly client: grpc.Client;
  private readonly methods: Methods;

  constructor(private readonly options: GatewayOptions) {
    this.methods = loadMethods(options.protoDir);
    this.client = new grpc.Client(options.address, grpc.credentials.createInsecure());
  }

  close(): void {
    this.client.close();
  }

  private metadata(): grpc.Metadata {
    const md = new grpc.Metadata();
    md.set("authorization", `Bearer ${this.options.token}`);
    return md;
  }

  private unary<Req extends object, Res>(rpc: Rpc<Req, Res>, request: Req): Promise<Res> {
    const options: grpc.CallOptions = { deadline: Date.now() + this.options.unaryTimeoutMs };
    return new Promise((resolve, reject) => {
      this.client.makeUnaryRequest(rpc.path, rpc.serialize, rpc.deserialize, request, this.metadata(), options, (err, response) => {
        if (err) reject(rpcError(rpc.name, err));
        else if (response === undefined) reject(new Error(`${rpc.name} answered nothing`));
        else resolve(response);
      });
    });
  }

  async createAutomation(request: CreateAutomationRequest): Promise<Automation> {
    const { automation } = await this.unary(this.methods.createAutomation, request);
    if (!automation) throw new Error("CreateAutomation answered no automation");
    return automation;
  }

  async runAutomationNow(request: RunAutomationNowRequest): Promise<Run> {
    const { run } = await this.unary(this.methods.runAutomationNow, request);
    if (!run) throw new Error("RunAutomationNow answered no run");
    return run;
  }

  async getRun(id: string): Promise<Run> {
    const { run } = await this.unary(this.methods.getRun, { id });
    if (!run) throw new Error("GetRun answered no run");
    return run;
  }

  /**
   * Follows a run's events after `afterSequence` until the server ends the
   * stream (after the run's terminal state), or `timeoutMs` passes (then
   * DEADLINE_EXCEEDED). The stream can be resumed after the last sequence
   * seen.
   */
  async *watchRun(runId: string, afterSequence: Int64, timeoutMs: number): AsyncGenerator<WatchRunResponse> {
    const rpc = this.methods.watchRun;
    const call = this.client.makeServerStreamRequest(
      rpc.path,
      rpc.serialize,
      rpc.deserialize,
      { run_id: runId, after_sequence: afterSequence },
      this.metadata(),
      { deadline: Date.now() + timeoutMs },
    );
    try {
      for await (const update of call as AsyncIterable<WatchRunResponse>) yield update;
    } catch (e) {
      throw rpcError(rpc.name, e);
    } finally {
      call.cancel();
    }
  }
}

/**
 * The studio's wire types, as the Django API serves them.
 *
 * GraphSpec mirrors `engine/spec/graph.py` (see `graphspec.schema.json`); everything
 * else mirrors the DRF serializers in `studio/workflows/api/serializers.py` and the
 * run events of `engine/flow/events.py`.
 */

export const PORT_TYPES = ["text", "tokens", "image", "audio", "tensor", "kv", "json", "any"] as const;
export type PortType = (typeof PORT_TYPES)[number];
export const JOIN_MODES = ["all", "ordered", "dynamic"] as const;
export type JoinMode = (typeof JOIN_MODES)[number];

/** Load-balancing policies a role may name (`engine/flow/balance.py` POLICY_NAMES). */
export const BALANCE_POLICIES = [
  "round_robin",
  "random",
  "least_outstanding",
  "power_of_two",
  "consistent_hash",
  "kv_aware",
] as const;

export const SPEC_VERSION = 1;
/** GraphSpec identifiers: node ids, role names, the workflow name. */
export const IDENT = /^[A-Za-z_][A-Za-z0-9_-]*$/;
/** Port names are identifiers too (the validator's `bad_port_name`). */
export const PORT_NAME = IDENT;

export interface PortSpec {
  type: PortType;
  optional?: boolean;
  join?: JoinMode | null;
  description?: string;
}

export interface RoleSpec {
  name: string;
  kind: string;
  model?: string | null;
  replicas?: number;
  /** Tensor-parallel rank processes per replica (default 1); only kinds with `tensor_parallel`. */
  tp_size?: number;
  device?: string;
  balance?: string;
  balance_params?: Record<string, unknown>;
  resources?: Record<string, unknown>;
  params?: Record<string, unknown>;
}

export interface NodeSpec {
  id: string;
  kind: string;
  role?: string | null;
  op?: string | null;
  params?: Record<string, unknown>;
  inputs?: Record<string, PortSpec>;
  outputs?: Record<string, PortSpec>;
  trigger?: string[][] | null;
  routes?: string[] | null;
  stream?: boolean;
  max_iterations?: number | null;
  retries?: number;
  timeout_s?: number | null;
  description?: string;
}

export interface EdgeSpec {
  source: string;
  source_port: string;
  target: string;
  target_port: string;
  stream?: boolean;
}

export interface GraphSpec {
  version: 1;
  name: string;
  roles: RoleSpec[];
  nodes: NodeSpec[];
  edges: EdgeSpec[];
  description?: string;
  meta?: Record<string, unknown>;
}

/** Where the editor keeps what GraphSpec does not: node positions and the viewport. */
export interface EditorLayout {
  nodes?: Record<string, { x: number; y: number }>;
  viewport?: { x: number; y: number; zoom: number };
}

/** One validation problem (`engine/flow/validate.py` Issue.to_dict). */
export interface Issue {
  code: string;
  message: string;
  node?: string;
  edge?: string;
  port?: string;
  role?: string;
  path?: string;
}

/** `POST /api/validate/?report=1`: valid or not, with every issue; `spec` (canonical) null when it does not parse. */
export interface ValidationResult {
  valid: boolean;
  issues: Issue[];
  spec: GraphSpec | null;
}

export type JsonSchema = {
  type?: string | string[];
  description?: string;
  default?: unknown;
  enum?: unknown[];
  minimum?: number;
  maximum?: number;
  exclusiveMinimum?: number;
  exclusiveMaximum?: number;
  minLength?: number;
  items?: JsonSchema;
  properties?: Record<string, JsonSchema>;
  required?: string[];
  additionalProperties?: boolean | JsonSchema;
};

/** `/api/node-kinds/`: `NodeKind.to_dict()`. Null ports: the node declares its own. */
export interface NodeKind {
  name: string;
  description: string;
  category: string;
  role_kinds: string[];
  params_schema: JsonSchema;
  inputs: Record<string, { type: PortType; optional: boolean }> | null;
  outputs: Record<string, { type: PortType; optional: boolean }> | null;
  op: "required" | "forbidden";
}

/** `/api/ops/`: a registered op a python node may name (`OpInfo.to_dict()`). */
export interface OpInfo {
  name: string;
  description: string;
  inputs: Record<string, { type: PortType; optional: boolean; join?: "all" | "ordered" | "dynamic" }>;
  outputs: Record<string, { type: PortType; optional: boolean }>;
  params_schema: JsonSchema;
  /** A generator: its node streams. */
  stream: boolean;
  /** Params naming folders the op writes into: names under the user's own folder on the server. */
  output_dirs: string[];
}

export interface RoleKind {
  name: string;
  description: string;
  params_schema: JsonSchema;
  /** Whether a role of this kind may set `tp_size` > 1. */
  tensor_parallel?: boolean;
  /** Whether its roles name a model (optional: the kind has a default). */
  model?: "required" | "optional" | "none";
}

export interface User {
  id: number;
  username: string;
  is_staff: boolean;
}

export interface Session {
  user: User | null;
  csrf_token: string;
}

export interface VersionSummary {
  number: number;
  valid: boolean;
  message: string;
  created_at: string;
  spec_hash: string;
}

export interface Workflow {
  id: string;
  name: string;
  description: string;
  owner: string;
  created_at: string;
  updated_at: string;
  latest_version: VersionSummary | null;
  version_count: number;
}

export interface Version {
  workflow: string;
  number: number;
  spec: GraphSpec;
  spec_hash: string;
  layout: EditorLayout;
  message: string;
  author: string | null;
  created_at: string;
  valid: boolean;
  issues: Issue[];
  /** Whether a deployment of it is a chat model on `/v1/chat/completions`. */
  chat: boolean;
}

/** A field that differs between two versions: absent before (`added`), absent after (`removed`) or changed. */
export interface FieldChange {
  from: unknown;
  to: unknown;
  change: "added" | "removed" | "changed";
}

export interface SectionDiff {
  added: string[];
  removed: string[];
  changed: { id: string; fields: Record<string, FieldChange> }[];
}

export interface VersionDiff {
  workflow: string;
  from_version: number;
  to_version: number;
  fields: Record<string, FieldChange>;
  roles: SectionDiff;
  nodes: SectionDiff;
  edges: SectionDiff;
  unified: string;
}

export interface Page<T> {
  count: number;
  next: string | null;
  previous: string | null;
  results: T[];
}

export const RUN_STATUSES = ["pending", "running", "done", "failed", "cancelled"] as const;
export type RunStatus = (typeof RUN_STATUSES)[number];
export const NODE_STATES = ["pending", "queued", "running", "done", "failed", "skipped", "cancelled"] as const;
export type NodeState = (typeof NODE_STATES)[number];

export interface Run {
  id: string;
  workflow: string;
  workflow_name: string;
  version: number;
  deployment: string | null;
  /** That deployment's name (may be blank); null for a run on the studio's own engine. */
  deployment_name: string | null;
  owner: string;
  status: RunStatus;
  inputs: Record<string, unknown>;
  outputs: Record<string, unknown>;
  error: string;
  failed_node: string;
  timeout_s: number | null;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  duration_ms: number | null;
  last_seq: number;
  /** A pending run's place in the queue (1: next to start); null once it runs. */
  queue_position: number | null;
  links: { self: string; events: string; cancel: string; websocket: string };
}

export interface NodeRun {
  node: string;
  kind: string;
  state: NodeState;
  attempts: number;
  iterations: number;
  started_at: string | null;
  finished_at: string | null;
  duration_ms: number | null;
  error: string;
  progress: number | null;
  message: string;
  outputs: Record<string, unknown>;
  frames: number;
}

export interface RunFile {
  id: string;
  /** "node": an image or audio clip a node produced, kept for the run view's previews. */
  role: "input" | "output" | "node";
  name: string;
  filename: string;
  content_type: string;
  size: number;
  sha256: string;
  created_at: string;
  url: string;
}

export interface RunDetail extends Run {
  nodes: NodeRun[];
  files: RunFile[];
  output_links: Record<string, string>;
  /** The server's clock (UNIX seconds) when it answered. */
  server_time: number;
  /** The version's GraphSpec and editor layout: the run view draws the graph with the run itself. */
  spec: GraphSpec;
  layout: EditorLayout;
  /** The roles that computed with seeded random weights (for testing): what they made is noise. */
  random_weights_roles: string[];
}

interface EventBase {
  seq: number;
  run_id: string;
  time: number;
}

export interface RunStartedEvent extends EventBase {
  type: "run_started";
  workflow: string;
  nodes: string[];
}
export interface NodeStateEvent extends EventBase {
  type: "node_state";
  node: string;
  state: NodeState;
  attempt?: number;
  iteration?: number;
  error?: string | null;
  /** With a terminal state, once the node has run: its time over every iteration and attempt. */
  duration_ms?: number | null;
  /** With `running`: the time it ran before this attempt (earlier iterations and attempts). */
  busy_ms?: number | null;
  /** With `running`: the worker that runs the attempt, and its host. */
  worker?: string | null;
  host?: string | null;
}
export interface NodeOutputEvent extends EventBase {
  type: "node_output";
  node: string;
  port: string;
  value: unknown;
  frame?: number | null;
  iteration?: number;
}
export interface NodeProgressEvent extends EventBase {
  type: "node_progress";
  node: string;
  progress?: number | null;
  message?: string;
}
export interface RunFinishedEvent extends EventBase {
  type: "run_finished";
  status: RunStatus;
  outputs?: Record<string, unknown>;
  error?: string | null;
  failed_node?: string | null;
  duration_ms?: number;
  /** Output name -> download URL, for outputs stored as files. */
  files?: Record<string, string>;
}
/** Written by the studio when a run whose executor stopped is executed again: every node is
 * pending again, and the new execution's events (from `run_started`) follow. */
export interface RunRestartedEvent extends EventBase {
  type: "run_restarted";
  attempt: number;
  error: string;
}
export type RunEvent =
  | RunStartedEvent
  | NodeStateEvent
  | NodeOutputEvent
  | NodeProgressEvent
  | RunFinishedEvent
  | RunRestartedEvent;

/** `/api/models/`: a model a role may name (a checkpoint by its name relative to a model root). */
export interface ModelInfo {
  name: string;
  source: "builtin" | "checkpoint";
  /** Seeded random weights: it runs, but its output is noise. */
  random_weights: boolean;
  /** "random weights (for testing)", "real weights" or "checkpoint". */
  label: string;
  description: string;
  role_kinds: string[];
  /** Per role kind, what a role of that kind naming it computes with (an LLM's diffusion head is seeded). */
  weights_by_kind?: Record<string, "real" | "random">;
}

export interface ModelList {
  models: ModelInfo[];
  /** The model roots hold more checkpoints than listed. */
  checkpoints_truncated: boolean;
}

/** `GET /api/models/<model>/chat-template/`: how a model renders chat messages. */
export interface ChatTemplateInfo {
  model: string;
  /** "model": its own chat template (smollm2-135m's); "simple": the studio's simple one (the tiny models). */
  template: "model" | "simple";
  /** What the template adds after a conversation for the reply to follow (SmolLM2's `<|im_start|>assistant\n`). */
  generation_prompt: string;
}

/** A chat message as the chat-template endpoint renders it. */
export interface ChatMessage {
  role: "system" | "developer" | "user" | "assistant";
  content: string;
}

/** `POST /api/models/<model>/chat-template/`: the messages as an llm node's prompt text. */
export interface RenderedPrompt {
  model: string;
  template: "model" | "simple";
  prompt: string;
}

/** `/api/tokens/`: one of the user's live API tokens (its text is never shown again). */
export interface ApiToken {
  id: number;
  name: string;
  /** The token's first characters, to recognise it. */
  prefix: string;
  created_at: string;
  /** Recorded at most once a minute. */
  last_used_at: string | null;
}

/** The answer to creating a token: the only time its text is sent. */
export interface NewApiToken extends ApiToken {
  token: string;
}

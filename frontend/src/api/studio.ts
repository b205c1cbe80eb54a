/** The studio's REST endpoints, typed. */
import { request } from "./client";
import type {
  ApiToken,
  ChatMessage,
  ChatTemplateInfo,
  EditorLayout,
  GraphSpec,
  Issue,
  ModelList,
  NewApiToken,
  NodeKind,
  OpInfo,
  Page,
  RenderedPrompt,
  RoleKind,
  RunDetail,
  Run,
  RunEvent,
  Session,
  ValidationResult,
  Version,
  VersionDiff,
  Workflow,
} from "./types";

export const auth = {
  session: () => request<Session>("GET", "/api/auth/session/"),
  login: (username: string, password: string) =>
    request<Session>("POST", "/api/auth/session/", { json: { username, password } }),
  logout: () => request<null>("DELETE", "/api/auth/session/"),
};

export const catalogue = {
  nodeKinds: () => request<NodeKind[]>("GET", "/api/node-kinds/"),
  roleKinds: () => request<RoleKind[]>("GET", "/api/role-kinds/"),
  ops: () => request<OpInfo[]>("GET", "/api/ops/"),
  /** Built-in models and the checkpoints under the studio's model roots. */
  models: () => request<ModelList>("GET", "/api/models/"),
  /** How `model` renders chat messages; null when the studio has no such model (or cannot read its tokenizer). */
  chatTemplate: (model: string) =>
    request<ChatTemplateInfo | null>("GET", chatTemplatePath(model), { allow: [404] }),
  /** `messages` rendered with `model`'s chat template: the text an llm node's prompt input expects. */
  renderChat: (model: string, messages: ChatMessage[], addGenerationPrompt = true) =>
    request<RenderedPrompt>("POST", chatTemplatePath(model), {
      json: { messages, add_generation_prompt: addGenerationPrompt },
    }),
};

/** A checkpoint's name keeps its slashes (`org/model`); each part is escaped. */
function chatTemplatePath(model: string): string {
  return `/api/models/${model.split("/").map(encodeURIComponent).join("/")}/chat-template/`;
}

/** The user's API tokens: for `Authorization: Bearer <token>` on the API and `/v1`. */
export const tokens = {
  list: () => request<ApiToken[]>("GET", "/api/tokens/"),
  create: (name: string) => request<NewApiToken>("POST", "/api/tokens/", { json: { name } }),
  revoke: (id: number) => request<null>("DELETE", `/api/tokens/${id}/`),
};

export const workflows = {
  list: (search = "") =>
    request<Page<Workflow>>("GET", `/api/workflows/${search ? `?search=${encodeURIComponent(search)}` : ""}`),
  get: (id: string) => request<Workflow>("GET", `/api/workflows/${id}/`),
  create: (body: { name: string; description?: string; spec?: GraphSpec; layout?: EditorLayout; message?: string }) =>
    request<Workflow>("POST", "/api/workflows/", { json: body }),
  update: (id: string, body: { name?: string; description?: string }) =>
    request<Workflow>("PATCH", `/api/workflows/${id}/`, { json: body }),
  remove: (id: string) => request<null>("DELETE", `/api/workflows/${id}/`),
  /** A .json GraphSpec or .py DSL file. */
  importFile: (file: File) => {
    const form = new FormData();
    form.append("file", file);
    return request<Workflow>("POST", "/api/workflows/import/", { form });
  },
  importText: (text: string, kind: "json" | "python") =>
    request<Workflow>("POST", "/api/workflows/import/", {
      text: { body: text, contentType: kind === "json" ? "application/json" : "text/x-python" },
    }),
  exportUrl: (id: string, format: "json" | "python", version?: number) =>
    `/api/workflows/${id}/export/?format=${format}${version ? `&version=${version}` : ""}`,
  exportText: (id: string, format: "json" | "python", version?: number) =>
    request<string | GraphSpec>("GET", workflows.exportUrl(id, format, version)),
  versions: (id: string) => request<Page<Version>>("GET", `/api/workflows/${id}/versions/`),
  version: (id: string, n: number) => request<Version>("GET", `/api/workflows/${id}/versions/${n}/`),
  saveVersion: (id: string, body: { spec: GraphSpec; layout: EditorLayout; message: string; base?: number }) =>
    request<Version>("POST", `/api/workflows/${id}/versions/`, { json: body }),
  diff: (id: string, n: number, against?: number) =>
    request<VersionDiff>(
      "GET",
      `/api/workflows/${id}/versions/${n}/diff/${against !== undefined ? `?against=${against}` : ""}`,
    ),
};

/**
 * Validate without saving: `[]` when valid, every issue otherwise. Asks for the report form
 * (`?report=1`): an invalid workflow answers 200 with its issues, so an editor checking each edit
 * of an incomplete graph makes no failed requests (browsers log every 4xx in the console).
 */
export async function validateSpec(spec: GraphSpec, signal?: AbortSignal): Promise<Issue[]> {
  const result = await request<ValidationResult>("POST", "/api/validate/?report=1", { json: { spec }, signal });
  return result.issues;
}

export interface RunFilters {
  status?: string;
  workflow?: string;
  page?: number;
}

export const runs = {
  list: (f: RunFilters = {}) => {
    const q = new URLSearchParams();
    if (f.status) q.set("status", f.status);
    if (f.workflow) q.set("workflow", f.workflow);
    if (f.page && f.page > 1) q.set("page", String(f.page));
    const qs = q.toString();
    return request<Page<Run>>("GET", `/api/runs/${qs ? `?${qs}` : ""}`);
  },
  get: (id: string) => request<RunDetail>("GET", `/api/runs/${id}/`),
  cancel: (id: string) => request<RunDetail>("POST", `/api/runs/${id}/cancel/`),
  events: (id: string, since: number) => request<RunEvent[]>("GET", `/api/runs/${id}/events/?since=${since}`),
  /** JSON when every input is a value; multipart (inputs as JSON, one file part per input) otherwise. */
  submit: (body: {
    workflow?: string;
    version?: number;
    deployment?: string;
    inputs: Record<string, unknown>;
    files?: Record<string, File>;
    timeout_s?: number;
  }) => {
    const { files, ...rest } = body;
    if (!files || Object.keys(files).length === 0) return request<RunDetail>("POST", "/api/runs/", { json: rest });
    const form = new FormData();
    for (const [k, v] of Object.entries(rest)) {
      if (v === undefined) continue;
      form.append(k, k === "inputs" ? JSON.stringify(v) : String(v));
    }
    for (const [name, file] of Object.entries(files)) form.append(name, file, file.name);
    return request<RunDetail>("POST", "/api/runs/", { form });
  },
};

/**
 * A text input of the New run form as a chat message. An llm node reads its `prompt` as the
 * model's own text: an instruct model (smollm2-135m) expects the conversation rendered in its chat
 * template and answers a plain question with nothing. So a text input that feeds llm prompts
 * whose model has a chat template gets a "Chat message" toggle (on by default): what the user
 * types is sent as a user message rendered with that template
 * (`POST /api/models/<model>/chat-template/`), as `/v1/chat/completions` renders it. Text that is
 * rendered already (pasted, or a previous run's input on "Run again") is sent as it is.
 */
import type { GraphSpec } from "../api/types";

/** Node kinds whose `prompt` input is the model's text (`llm.decode` takes none). */
export const PROMPT_KINDS: readonly string[] = ["llm", "llm.prefill"];

/**
 * For each text input whose every edge feeds the `prompt` of a `PROMPT_KINDS` node, the model those
 * nodes' roles name: one model for all of them (inputs feeding other ports, or nodes on roles with no
 * model or with different models, are left out: their text is not one model's prompt alone).
 */
export function chatInputs(spec: GraphSpec): Record<string, string> {
  const nodes = new Map(spec.nodes.map((n) => [n.id, n]));
  const roles = new Map(spec.roles.map((r) => [r.name, r]));
  const found: Record<string, string> = {};
  for (const input of spec.nodes) {
    if (input.kind !== "input" || input.outputs?.value?.type !== "text") continue;
    const edges = spec.edges.filter((e) => e.source === input.id);
    const models = new Set<string | null>();
    for (const edge of edges) {
      const target = nodes.get(edge.target);
      const fed = target && PROMPT_KINDS.includes(target.kind) && edge.target_port === "prompt";
      models.add(fed ? (roles.get(target.role ?? "")?.model ?? null) : null);
    }
    const [model] = models;
    if (models.size === 1 && model) found[input.id] = model;
  }
  return found;
}

/**
 * Whether `text` holds the template's generation prompt already (SmolLM2's `<|im_start|>assistant`):
 * a rendered conversation, sent as it is. A template that adds nothing recognises nothing.
 */
export function isRendered(text: string, generationPrompt: string): boolean {
  const marker = generationPrompt.trim();
  return marker !== "" && text.includes(marker);
}

/** What the form sends for a chat input's text: rendered as a user message, or as it is. */
export function chatSend(text: string, chatOn: boolean, generationPrompt: string): "render" | "as-is" {
  return chatOn && text.trim() !== "" && !isRendered(text, generationPrompt) ? "render" : "as-is";
}

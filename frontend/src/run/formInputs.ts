/**
 * The New run form's fields: one per workflow input, and what each starts from. A field starts
 * from a previous run's value ("Run again"), else from the input's `example` (what a person would
 * type: the `chat` workflow's plain question, where its default is that question rendered in the
 * model's chat template), else from its default.
 */
import type { NodeSpec, PortType } from "../api/types";

export interface InputField {
  name: string;
  type: PortType;
  defaultValue: unknown;
  /** What the form pre-fills instead of the default (`params.example` of the input node). */
  example: string | undefined;
  description: string;
}

/** `chat`: a chat input's toggle (on by default). */
export type Draft = { text: string; file: File | null; asJson: boolean; chat: boolean };

export function inputsOf(nodes: NodeSpec[]): InputField[] {
  return nodes
    .filter((n) => n.kind === "input")
    .map((n) => ({
      name: n.id,
      type: n.outputs?.value?.type ?? "any",
      defaultValue: n.params?.default,
      example: typeof n.params?.example === "string" ? n.params.example : undefined,
      description: n.description ?? "",
    }));
}

/** A field's draft: from `given` (a previous run's value) when there is one, else its example, else its default. */
export function initialDraft(field: InputField, given?: unknown): Draft {
  const draft = (text: string, asJson: boolean): Draft => ({ text, file: null, asJson, chat: true });
  if (given !== undefined && !(given && typeof given === "object" && "$file" in given)) {
    if (typeof given === "string" && (field.type === "text" || field.type === "any")) return draft(given, false);
    return draft(JSON.stringify(given), true);
  }
  if (field.example !== undefined && (field.type === "text" || field.type === "any")) return draft(field.example, false);
  const d = field.defaultValue;
  if (d === undefined) return draft("", field.type !== "text");
  if (typeof d === "string" && (field.type === "text" || field.type === "any")) return draft(d, false);
  return draft(JSON.stringify(d), true);
}

import { describe, expect, it } from "vitest";
import type { EdgeSpec, GraphSpec, NodeSpec, RoleSpec } from "../api/types";
import { chatInputs, chatSend, isRendered } from "./chatPrompt";
import chat from "./fixtures/chat.json";
import pdChat from "./fixtures/pd_chat.json";

const SMOL = "<|im_start|>assistant\n";

const text = (id: string): NodeSpec => ({ id, kind: "input", outputs: { value: { type: "text" } } });
const edge = (source: string, target: string, target_port: string): EdgeSpec => ({
  source, source_port: "value", target, target_port,
});

/** Inputs `q` (text) and `n` (json); llm nodes `a` on role `lm`, `b` on role `other`; a python node `py`. */
function spec(edges: EdgeSpec[], roles: Partial<Record<string, string | null>> = {}): GraphSpec {
  const role = (name: string, kind: string, model: string | null): RoleSpec => ({ name, kind, model });
  const model = (name: string) => (name in roles ? (roles[name] ?? null) : "smollm2-135m");
  return {
    version: 1,
    name: "t",
    roles: [role("lm", "llm", model("lm")), role("other", "llm", model("other")), role("py", "python", null)],
    nodes: [text("q"), { id: "n", kind: "input", outputs: { value: { type: "json" } } },
            { id: "a", kind: "llm", role: "lm" }, { id: "b", kind: "llm.prefill", role: "other" },
            { id: "py", kind: "python", role: "py", op: "x" }],
    edges,
  };
}

describe("the New run form's chat inputs", () => {
  it("are the example chat workflows' prompts, on their model", () => {
    expect(chatInputs(chat as unknown as GraphSpec)).toEqual({ prompt: "smollm2-135m" });
    expect(chatInputs(pdChat as unknown as GraphSpec)).toEqual({ prompt: "smollm2-135m" });
  });

  it("are text inputs whose every edge feeds an llm prompt of one model", () => {
    expect(chatInputs(spec([edge("q", "a", "prompt"), edge("q", "b", "prompt")]))).toEqual({ q: "smollm2-135m" });
    expect(chatInputs(spec([edge("n", "a", "prompt")]))).toEqual({}); // not a text input
    expect(chatInputs(spec([]))).toEqual({}); // feeds nothing
  });

  it("leave out an input that also feeds another port, a python node, or another model", () => {
    expect(chatInputs(spec([edge("q", "a", "prompt"), edge("q", "py", "text")]))).toEqual({});
    expect(chatInputs(spec([edge("q", "a", "prompt"), edge("q", "b", "items")]))).toEqual({});
    expect(chatInputs(spec([edge("q", "a", "prompt"), edge("q", "b", "prompt")], { other: "org/ckpt" }))).toEqual({});
    expect(chatInputs(spec([edge("q", "a", "prompt")], { lm: null }))).toEqual({}); // a role with no model
  });
});

describe("what a chat input sends", () => {
  it("renders a plain question while the toggle is on", () => {
    expect(chatSend("What is the capital of France?", true, SMOL)).toBe("render");
    expect(chatSend("What is the capital of France?", false, SMOL)).toBe("as-is");
  });

  it("sends a rendered conversation as it is, and leaves an empty field to the workflow's default", () => {
    const rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    expect(isRendered(rendered, SMOL)).toBe(true);
    expect(chatSend(rendered, true, SMOL)).toBe("as-is");
    expect(chatSend("  ", true, SMOL)).toBe("as-is");
  });

  it("recognises nothing as rendered for a template whose generation prompt is empty", () => {
    expect(isRendered("<|im_start|>assistant", "")).toBe(false);
    expect(chatSend("anything", true, "")).toBe("render");
  });
});

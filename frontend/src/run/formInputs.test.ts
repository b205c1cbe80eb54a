import { describe, expect, it } from "vitest";
import type { GraphSpec } from "../api/types";
import { chatSend } from "./chatPrompt";
import chat from "./fixtures/chat.json";
import { initialDraft, inputsOf } from "./formInputs";

const SMOL = "<|im_start|>assistant\n";

describe("the chat workflow's New run form", () => {
  const [prompt] = inputsOf((chat as unknown as GraphSpec).nodes);

  it("starts from the plain question a person would type, not the rendered template", () => {
    const draft = initialDraft(prompt);
    expect(draft.text).toBe("What is the capital of France?");
    expect(draft.text).not.toContain("<|im_start|>");
    expect(draft.chat).toBe(true);
    expect(chatSend(draft.text, draft.chat, SMOL)).toBe("render");
  });

  it("whose default is that question rendered (what the command line sends)", () => {
    expect(prompt.defaultValue).toBe(
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n" +
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    );
  });

  it("Run again starts from the previous run's value, not the example", () => {
    expect(initialDraft(prompt, "<|im_start|>user\nHi<|im_end|>\n").text).toBe("<|im_start|>user\nHi<|im_end|>\n");
  });
});

describe("an input with no example", () => {
  it("starts from its default", () => {
    const field = { name: "n", type: "json" as const, defaultValue: [1, 2], example: undefined, description: "" };
    expect(initialDraft(field)).toEqual({ text: "[1,2]", file: null, asJson: true, chat: true });
  });
});

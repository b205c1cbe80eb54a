import { describe, expect, it } from "vitest";
import { middleEllipsis } from "./ellipsis";

describe("middleEllipsis", () => {
  it("keeps a text that fits whole", () => {
    expect(middleEllipsis("", 3, 3)).toBe("");
    expect(middleEllipsis("abcdefg", 3, 3)).toBe("abcdefg"); // 7 = 3 + 1 + 3: the ellipsis would save nothing
  });

  it("keeps the start and the end of a longer one", () => {
    expect(middleEllipsis("abcdefgh", 3, 3)).toBe("abc…fgh");
    // A deployment's worker id: the deployment cut short, the role, replica and pid kept.
    expect(middleEllipsis("diamond-1a2b3c4d-py-0-12345", 10, 10)).toBe("diamond-1a…py-0-12345");
    expect(middleEllipsis("omni_dialogue-0f3e9a1c-dialogue_llm-0-48213.tp1", 10, 10)).toBe("omni_dialo…-48213.tp1");
  });

  it("counts characters, not UTF-16 units", () => {
    expect(middleEllipsis("ab😀cdefgh😀", 2, 2)).toBe("ab…h😀");
  });

  it("refuses to keep nothing of an end", () => {
    expect(() => middleEllipsis("abcdef", 0, 2)).toThrow(/head 0/);
    expect(() => middleEllipsis("abcdef", 2, 1.5)).toThrow(/tail 1.5/);
  });
});

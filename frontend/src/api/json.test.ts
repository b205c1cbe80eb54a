import { describe, expect, it } from "vitest";
import { jsonPath, parseUserJson } from "./json";

describe("parseUserJson", () => {
  it("parses JSON as JSON.parse does", () => {
    expect(parseUserJson('{"n": 1e200, "a": [1, "x", null]}')).toEqual({ n: 1e200, a: [1, "x", null] });
    expect(parseUserJson("42")).toBe(42);
  });

  it("refuses a number JSON.parse reads as Infinity, naming its place", () => {
    expect(() => parseUserJson("1e400")).toThrow("the number at $ is beyond");
    expect(() => parseUserJson('{"a": [1, -1e999]}')).toThrow("$.a[1]");
    expect(() => parseUserJson('{"x y": {"n": 1e400}}')).toThrow('$["x y"].n');
  });

  it("says what is wrong with text that is not JSON", () => {
    expect(() => parseUserJson("omni")).toThrow(SyntaxError);
  });

  it("writes paths as the server does", () => {
    expect(jsonPath([])).toBe("$");
    expect(jsonPath(["a.b", 0, "c"])).toBe('$["a.b"][0].c');
  });
});

import { describe, expect, it } from "vitest";
import { ApiError, describeError } from "./client";

describe("describeError", () => {
  it("names the field a detail is about", () => {
    const err = new ApiError(400, "invalid request", [
      { field: "timeout_s", message: "Ensure this value is less than or equal to 86400." },
      { message: "no field here" },
      "plain text",
    ]);
    expect(describeError(err)).toBe(
      "invalid request: timeout_s: Ensure this value is less than or equal to 86400.; no field here; plain text",
    );
  });

  it("is the message alone without details", () => {
    expect(describeError(new ApiError(404, "not found"))).toBe("not found");
    expect(describeError(new Error("boom"))).toBe("boom");
  });
});

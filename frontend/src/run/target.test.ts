import { describe, expect, it } from "vitest";
import { defaultTarget, deploymentLabel } from "./target";

const none = { deployment: null, version: null, from: null };
const one = [{ id: "d1", version: 3 }];

describe("the new-run form's default target", () => {
  it("is the workflow's running deployment when there is exactly one", () => {
    expect(defaultTarget(none, one)).toBe("d1");
    expect(defaultTarget({ ...none, version: 3 }, one)).toBe("d1");
  });

  it("is the studio's engine when no deployment runs, or several do (the user chooses)", () => {
    expect(defaultTarget(none, [])).toBe("");
    expect(defaultTarget(none, [...one, { id: "d2", version: 3 }])).toBe("");
  });

  it("is the studio's engine for a version the deployment does not run, or a run again of an engine run", () => {
    expect(defaultTarget({ ...none, version: 2 }, one)).toBe("");
    expect(defaultTarget({ ...none, version: 3, from: "r1" }, one)).toBe("");
  });

  it("is the deployment asked for, running or not (the form says when it is not)", () => {
    expect(defaultTarget({ ...none, deployment: "d9", from: "r1" }, one)).toBe("d9");
    expect(defaultTarget({ ...none, deployment: "d9" }, [])).toBe("d9");
  });
});

describe("the deployment a run names", () => {
  it("is its name, the start of its id when unnamed, none for a run on the studio's engine", () => {
    const id = "0123456789abcdef";
    expect(deploymentLabel({ deployment: id, deployment_name: "chat" })).toBe("chat");
    expect(deploymentLabel({ deployment: id, deployment_name: "" })).toBe("01234567");
    expect(deploymentLabel({ deployment: null, deployment_name: null })).toBeNull();
  });
});

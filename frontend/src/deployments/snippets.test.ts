import { describe, expect, it } from "vitest";
import readme from "../../../README.md?raw";
import { curlSnippet, openaiBaseUrl, pythonSnippet, runSnippet, shellQuote } from "./snippets";

describe("endpoint snippets", () => {
  it("puts the studio's /v1 and the deployment's name in both", () => {
    const base = openaiBaseUrl("http://127.0.0.1:8000/");
    expect(base).toBe("http://127.0.0.1:8000/v1");
    expect(curlSnippet(base, "chat")).toContain("curl -sS 'http://127.0.0.1:8000/v1/chat/completions'");
    expect(curlSnippet(base, "chat")).toContain('"model":"chat"');
    expect(curlSnippet(base, "chat")).toContain('"Authorization: Bearer $OMNIFLOW_TOKEN"');
    expect(pythonSnippet(base, "chat")).toContain('model="chat",');
    expect(pythonSnippet(base, "chat")).toContain('api_key=os.environ["OMNIFLOW_TOKEN"]');
  });

  it("is what the README shows for the model chat of a studio at make run's address", () => {
    expect(readme).toContain(`\`\`\`python\n${pythonSnippet("http://127.0.0.1:8000/v1", "chat")}\n\`\`\``);
  });

  it("quotes names a shell or Python would read otherwise", () => {
    expect(shellQuote("it's $HOME")).toBe("'it'\\''s $HOME'");
    const curl = curlSnippet("http://x/v1", `bob's "bot"`);
    expect(curl).toContain(`'{"model":"bob'\\''s \\"bot\\"",`);
    expect(pythonSnippet("http://x/v1", `a"b\\c`)).toContain('model="a\\"b\\\\c",');
  });
});

describe("the run snippet of a deployment that is not a chat workflow", () => {
  it("names every input, at its default or a sample of its type", () => {
    const text = runSnippet("http://x/", "d1", [
      { name: "n", type: "json", default: 5 },
      { name: "caption", type: "text" },
    ]);
    expect(text).toContain("curl -sS 'http://x/api/runs/'");
    expect(text).toContain('{"deployment":"d1","inputs":{"n":5,"caption":"hello"}}');
  });
});

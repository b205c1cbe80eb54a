/**
 * Client snippets for a deployment's OpenAI endpoint that work as pasted: the token comes
 * from the `OMNIFLOW_TOKEN` environment variable (made on the API tokens page), the base URL
 * is this studio's, the model is the deployment's name. curl runs with `-sS`: no progress meter
 * on stderr when pasted into a script, but its errors still show.
 */

export const TOKEN_ENV = "OMNIFLOW_TOKEN";
export const SAMPLE_MESSAGE = "Hello!";

/** The OpenAI base URL of the studio at `origin` (e.g. `http://127.0.0.1:8000/v1`). */
export function openaiBaseUrl(origin: string): string {
  return `${origin.replace(/\/+$/, "")}/v1`;
}

/** `text` as one POSIX shell word (single quotes; a quote inside becomes '\''). */
export function shellQuote(text: string): string {
  return `'${text.replace(/'/g, `'\\''`)}'`;
}

/** A Python string literal of `text` (JSON's escapes are Python's too). */
export function pyString(text: string): string {
  return JSON.stringify(text);
}

export function curlSnippet(baseUrl: string, model: string): string {
  const body = JSON.stringify({ model, messages: [{ role: "user", content: SAMPLE_MESSAGE }] });
  return [
    `curl -sS ${shellQuote(`${baseUrl}/chat/completions`)} \\`,
    `  -H "Authorization: Bearer $${TOKEN_ENV}" \\`,
    `  -H "Content-Type: application/json" \\`,
    `  -d ${shellQuote(body)}`,
  ].join("\n");
}

export function pythonSnippet(baseUrl: string, model: string): string {
  return [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${pyString(baseUrl)}, api_key=os.environ[${pyString(TOKEN_ENV)}])`,
    "reply = client.chat.completions.create(",
    `    model=${pyString(model)},`,
    `    messages=[{"role": "user", "content": ${pyString(SAMPLE_MESSAGE)}}],`,
    ")",
    "print(reply.choices[0].message.content)",
  ].join("\n");
}

/** A sample value for an input of `type` that has no default. */
function sample(type: string): unknown {
  return type === "text" ? "hello" : type === "tokens" ? [1, 2, 3] : 1;
}

/**
 * For a deployment that is not a chat workflow: a run of it through the REST API, with every
 * input at its default, or a sample value of its type where it has none.
 */
export function runSnippet(origin: string, deploymentId: string, inputs: { name: string; type: string; default?: unknown }[]): string {
  const values = Object.fromEntries(inputs.map((i) => [i.name, "default" in i ? i.default : sample(i.type)]));
  const body = JSON.stringify({ deployment: deploymentId, inputs: values });
  return [
    `curl -sS ${shellQuote(`${origin.replace(/\/+$/, "")}/api/runs/`)} \\`,
    `  -H "Authorization: Bearer $${TOKEN_ENV}" \\`,
    `  -H "Content-Type: application/json" \\`,
    `  -d ${shellQuote(body)}`,
  ].join("\n");
}

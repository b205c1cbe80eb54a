/**
 * JSON a user types, parsed for sending: `JSON.parse` reads a number past the largest double
 * (`1e400`) as Infinity, which `JSON.stringify` then sends as null, so the server would get a
 * value the user never wrote. `parseUserJson` refuses such a number, naming where it is.
 */

/** Where `path` (keys and indexes from the top) is in a JSON document: `$.a[2]["b c"]`. */
export function jsonPath(path: (string | number)[]): string {
  return path.reduce<string>(
    (at, part) =>
      typeof part === "number" ? `${at}[${part}]` : /^[A-Za-z_][A-Za-z0-9_]*$/.test(part) ? `${at}.${part}` : `${at}[${JSON.stringify(part)}]`,
    "$",
  );
}

function firstNonFinite(value: unknown, path: (string | number)[]): (string | number)[] | null {
  if (typeof value === "number") return Number.isFinite(value) ? null : path;
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) {
      const found = firstNonFinite(value[i], [...path, i]);
      if (found) return found;
    }
    return null;
  }
  if (value !== null && typeof value === "object") {
    for (const [key, item] of Object.entries(value)) {
      const found = firstNonFinite(item, [...path, key]);
      if (found) return found;
    }
  }
  return null;
}

/** `text` parsed as JSON; throws an Error saying what is wrong (not JSON, or a number past the largest one JSON carries, and where). */
export function parseUserJson(text: string): unknown {
  const value: unknown = JSON.parse(text);
  const at = firstNonFinite(value, []);
  if (at) throw new Error(`the number at ${jsonPath(at)} is beyond the largest one JSON carries (about 1.8e308)`);
  return value;
}

/** Shortening a text that must keep both of its ends (ids whose start and end say what they are). */

/**
 * `text` in at most `head` + 1 + `tail` characters: whole when it fits, else its first `head` and its
 * last `tail` characters around an ellipsis ("…"). Counts characters, not UTF-16 units.
 */
export function middleEllipsis(text: string, head: number, tail: number): string {
  if (!Number.isInteger(head) || !Number.isInteger(tail) || head < 1 || tail < 1) {
    throw new RangeError(`middleEllipsis keeps at least one character each side: head ${head}, tail ${tail}`);
  }
  const chars = Array.from(text);
  if (chars.length <= head + 1 + tail) return text;
  return `${chars.slice(0, head).join("")}…${chars.slice(chars.length - tail).join("")}`;
}

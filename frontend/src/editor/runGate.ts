/**
 * Whether the editor's Run button may run the saved version, and what it says when it may not.
 * Run always runs the saved version (`base`), so its issues, not the document's, decide: a saved
 * draft with issues cannot run until the fixes are saved as a newer version.
 */
export interface RunGate {
  disabled: boolean;
  /** The button's tooltip; undefined where nothing needs saying. */
  title: string | undefined;
  /**
   * What to ask before leaving for the run form: Run opens another page, so unsaved edits would be
   * lost (as the Back link asks); undefined where nothing would be.
   */
  confirm: string | undefined;
}

const issues = (count: number) => `${count} issue${count === 1 ? "" : "s"}`;

/** `base`: the saved version (null before the first save); `savedIssues`: how many issues it has. */
export function runGate(base: number | null, savedIssues: number, dirty: boolean): RunGate {
  if (base === null) return { disabled: true, title: "Save a version first", confirm: undefined };
  if (savedIssues > 0) {
    return { disabled: true, title: `v${base} has ${issues(savedIssues)}: fix and save to run it`, confirm: undefined };
  }
  if (!dirty) return { disabled: false, title: undefined, confirm: undefined };
  return {
    disabled: false,
    title: `Runs the saved version v${base}`,
    confirm: `Leave the editor to run the saved version v${base}? Your unsaved changes will be lost.`,
  };
}

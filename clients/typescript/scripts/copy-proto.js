#!/usr/bin/env node
// Build step: the package carries its own copy of the repo's wire contract,
// proto/triage/v1/triage.proto, verbatim, so a published package needs nothing from the
// repo. Outside the repo (an installed package) the shipped copy is kept.
"use strict";

const fs = require("node:fs");
const path = require("node:path");

const here = path.resolve(__dirname, "..");
const source = path.resolve(here, "..", "..", "proto", "triage", "v1", "triage.proto");
const target = path.join(here, "proto", "triage", "v1", "triage.proto");

function main() {
  if (!fs.existsSync(source)) {
    if (fs.existsSync(target)) {
      return; // an installed package: keep the copy it shipped with
    }
    throw new Error(`neither ${source} nor ${target} exists`);
  }
  const text = fs.readFileSync(source, "utf8");
  fs.mkdirSync(path.dirname(target), { recursive: true });
  if (!fs.existsSync(target) || fs.readFileSync(target, "utf8") !== text) {
    fs.writeFileSync(target, text);
  }
}

module.exports = { source, target };

if (require.main === module) {
  main();
}

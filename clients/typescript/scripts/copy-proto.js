#!/usr/bin/env node
// Build step: the package carries its own copy of the repo's wire contract,
// proto/triage/v1/triage.proto, so a published package needs nothing from the repo.
//
// The copy is the repo's file verbatim, except while the repo's Hello lacks
// `max_frame_bytes` (field 4, added by issue 13): then that one field is added to the
// copy, so this client can say how large a frame it receives (an older proxy ignores
// an unknown field). Outside the repo (an installed package) the shipped copy is kept.
"use strict";

const fs = require("node:fs");
const path = require("node:path");

const here = path.resolve(__dirname, "..");
const source = path.resolve(here, "..", "..", "proto", "triage", "v1", "triage.proto");
const target = path.join(here, "proto", "triage", "v1", "triage.proto");

/** The repo's proto text as this package carries it (see the comment at the top). */
function packaged(text) {
  if (/\bmax_frame_bytes\s*=\s*4\s*;/.test(text)) {
    return text;
  }
  const hello = /(message Hello \{[\s\S]*?optional int32 partition = 3;\n)/;
  if (!hello.test(text)) {
    throw new Error(`cannot find Hello.partition in ${source} to add max_frame_bytes after it`);
  }
  return text.replace(
    hello,
    "$1  // Largest frame this client receives, in bytes (absent: 4 MiB). Added by the\n" +
      "  // TypeScript client's build while the repo's proto lacks it.\n" +
      "  optional uint32 max_frame_bytes = 4;\n",
  );
}

function main() {
  if (!fs.existsSync(source)) {
    if (fs.existsSync(target)) {
      return; // an installed package: keep the copy it shipped with
    }
    throw new Error(`neither ${source} nor ${target} exists`);
  }
  const text = packaged(fs.readFileSync(source, "utf8"));
  fs.mkdirSync(path.dirname(target), { recursive: true });
  if (!fs.existsSync(target) || fs.readFileSync(target, "utf8") !== text) {
    fs.writeFileSync(target, text);
  }
}

module.exports = { packaged, source, target };

if (require.main === module) {
  main();
}

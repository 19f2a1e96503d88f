// A reply's text as sanitized Markdown, each character coloured by the
// source of the token it came from.
//
// A reply is a list of segments [text, source], source one of "drafter",
// "mtp", "draft-model", "eagle3", "dflash", "lookup", "datastore", "llm" (the server's
// x_redrafter.sources). The Markdown is
// rendered from the whole text, then sanitized, then the characters of the
// rendered text nodes are matched in order against the reply's text to find
// their source: Markdown only removes syntax characters, so what is shown is
// (nearly) a subsequence of what was said. A character that cannot be matched
// stays uncoloured, it never breaks the rendering.

const { marked, DOMPurify } = window;

marked.setOptions({ gfm: true, breaks: true });

// Links from the model open in a new tab without access to this page.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// How far ahead in the reply's text a shown character is looked for.
const WINDOW = 200;

/** Sanitized HTML of Markdown `text`: no HTML from the model ever runs. */
export function markdownHTML(text) {
  return DOMPurify.sanitize(marked.parse(text), {
    USE_PROFILES: { html: true },
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
  });
}

/** Render `segments` into `el` as Markdown with source-coloured spans. */
export function renderReply(el, segments) {
  const chars = [];
  const sources = [];
  for (const [text, source] of segments) {
    for (let i = 0; i < text.length; i++) {
      chars.push(text[i]);
      sources.push(source);
    }
  }
  el.innerHTML = markdownHTML(chars.join(""));
  colourTextNodes(el, chars, sources);
}

function colourTextNodes(root, chars, sources) {
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let pos = 0;
  for (const node of nodes) {
    const shown = node.data;
    const found = new Array(shown.length).fill("llm");
    for (let i = 0; i < shown.length; i++) {
      const c = shown[i];
      if (/\s/.test(c)) {
        // Markdown adds and folds whitespace: only take it when it is next.
        if (pos < chars.length && /\s/.test(chars[pos])) found[i] = sources[pos++];
        continue;
      }
      const end = Math.min(chars.length, pos + WINDOW);
      for (let j = pos; j < end; j++) {
        if (chars[j] === c) {
          found[i] = sources[j];
          pos = j + 1;
          break;
        }
      }
    }
    wrapRuns(node, shown, found);
  }
}

function wrapRuns(node, shown, found) {
  if (found.every((s) => s === "llm")) return;
  const frag = document.createDocumentFragment();
  let start = 0;
  for (let i = 1; i <= shown.length; i++) {
    if (i < shown.length && found[i] === found[start]) continue;
    const piece = document.createTextNode(shown.slice(start, i));
    if (found[start] === "llm") {
      frag.appendChild(piece);
    } else {
      const span = document.createElement("span");
      span.className = "src-" + found[start];
      span.appendChild(piece);
      frag.appendChild(span);
    }
    start = i;
  }
  node.replaceWith(frag);
}

/** The colour of a chunk that holds several tokens' text: a draft's if any. */
export function chunkSource(sources) {
  if (!sources || !sources.length) return "llm";
  return sources.find((s) => s !== "llm") || "llm";
}

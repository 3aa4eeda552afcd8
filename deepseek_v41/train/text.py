"""Documents as plain text: HTML to text, text clean-up, and the keys used for deduplication and the split.

HTML pages are reduced to the text of their main content (Sphinx puts it in ``role="main"``; pages without that
element give their whole body) with the standard library's :class:`html.parser.HTMLParser`: block elements start
new lines, ``<pre>`` keeps its whitespace, everything else collapses runs of whitespace to one space; scripts,
styles and Sphinx permalink anchors (``¶``) are dropped. reStructuredText and plain text are kept as written.

Two keys identify a document: the *exact* key hashes the cleaned text; the *near* key hashes its normalised form
(NFKC, case-folded, only the word characters kept, one space between words), so copies that differ in case,
punctuation, whitespace or line wrapping collapse to one key.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from html.parser import HTMLParser

# Elements that never have an end tag: they must not open a level of nesting.
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
# Elements whose text is not content.
_SKIP = {"script", "style", "noscript", "template", "head", "title"}
# Elements that start a paragraph (blank line) or a line.
_PARAGRAPH = {"p", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "dl", "table", "blockquote", "section",
              "article", "figure", "hr"}
_LINE = {"div", "li", "dt", "dd", "tr", "br", "caption", "figcaption", "details", "summary"}


class _MainText(HTMLParser):
    """Collects the page text in ``out`` and where the ``role="main"`` element starts and ends in it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.depth = 0  # open elements (void elements excluded)
        self.main_depth: int | None = None  # depth of the open role="main" element
        self.main: tuple[int, int] | None = None  # its [start, end) in ``out``
        self.skip_depth: int | None = None  # depth of the open element whose text is dropped
        self.pre = 0
        self.breaks = 0  # newlines owed before the next text

    def _block(self, tag: str) -> None:
        if tag in _PARAGRAPH:
            self.breaks = max(self.breaks, 2)
        elif tag in _LINE:
            self.breaks = max(self.breaks, 1)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._block(tag)
        if tag in ("td", "th") and self.out and not self.out[-1].endswith((" ", "\n")):
            self.out.append(" ")  # adjacent cells would otherwise run together
        if tag in _VOID:
            return
        self.depth += 1
        attr = dict(attrs)
        if self.skip_depth is None and (tag in _SKIP or "headerlink" in (attr.get("class") or "").split()):
            self.skip_depth = self.depth
        if attr.get("role") == "main" and self.main is None and self.main_depth is None:
            self.main_depth = self.depth
            self.main = (len(self.out), -1)
        self.pre += tag == "pre"

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._block(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        self._block(tag)
        self.pre -= tag == "pre" and self.pre > 0
        if self.skip_depth == self.depth:
            self.skip_depth = None
        if self.main_depth == self.depth:
            self.main_depth = None
            self.main = (self.main[0], len(self.out))
        self.depth = max(0, self.depth - 1)

    def handle_data(self, data: str) -> None:
        if self.skip_depth is not None:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if self.breaks and not data.strip():
                return  # whitespace between blocks: the break stands for it
        if self.breaks and self.out:
            have = len(self.out[-1]) - len(self.out[-1].rstrip("\n"))
            self.out.append("\n" * max(0, self.breaks - have))
        self.breaks = 0
        if not self.pre and (not self.out or self.out[-1].endswith("\n")):
            data = data.lstrip(" ")
        if data:
            self.out.append(data)

    def text(self) -> str:
        if self.main is None:
            return "".join(self.out)
        start, end = self.main
        return "".join(self.out[start:end if end >= 0 else len(self.out)])


def html_to_text(html: str) -> str:
    """The text of an HTML page's main content (see the module docstring), cleaned by :func:`clean_text`.

    ``html`` is the decoded page; returns "" for a page without text. Never raises on malformed HTML (the
    parser is lenient: unclosed elements end with the page).
    """
    parser = _MainText()
    parser.feed(html)
    parser.close()
    return clean_text(parser.text())


def clean_text(text: str) -> str:
    """Newlines normalised to ``\\n``, trailing spaces of every line removed, at most two blank lines in a row,
    blank lines at both ends removed. Tabs and indentation are kept (code)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    text = re.sub(r"[ \t\f\v]+\n", "\n", text)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n").rstrip()


def normalize_for_dedup(text: str) -> str:
    """The near-duplicate form of a text: NFKC, case-folded, word characters only, single spaces."""
    return " ".join(re.findall(r"\w+", unicodedata.normalize("NFKC", text).casefold()))


def exact_key(text: str) -> str:
    """sha256 hex digest of the cleaned text (UTF-8)."""
    return hashlib.sha256(clean_text(text).encode("utf-8")).hexdigest()


def near_key(text: str) -> str:
    """sha256 hex digest of :func:`normalize_for_dedup` of the text (UTF-8)."""
    return hashlib.sha256(normalize_for_dedup(text).encode("utf-8")).hexdigest()

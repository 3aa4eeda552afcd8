"""HTML to text, clean-up and the deduplication keys, on small inline pages written the way Sphinx writes them."""

import hashlib

from deepseek_v41.train.text import clean_text, exact_key, html_to_text, near_key, normalize_for_dedup

SPHINX_PAGE = """<!DOCTYPE html>
<html><head><title>abs - Python</title><style>body { color: red }</style>
<script>var x = "not text";</script></head>
<body>
<div class="related" role="navigation"><a href="index.html">index</a> | <a href="x.html">next</a></div>
<div class="document"><div class="body" role="main">
  <section id="built-in">
<h1>Built-in Functions<a class="headerlink" href="#built-in" title="Permalink">¶</a></h1>
<p>The   Python interpreter
   has a number of <code class="xref"><span class="pre">functions</span></code> &amp; types.<br>Second line.</p>
<div class="highlight"><pre><span></span><span class="k">def</span> <span class="nf">f</span>(x):
    return  x   +  1
</pre></div>
<ul><li><p>one</p></li><li><p>two</p></li></ul>
<table><tr><td>a</td><td>b</td></tr></table>
<img src="x.png" alt="picture"><p>After &lt;image&gt; caf&eacute;</p>
</section>
</div></div>
<div class="footer">&copy; Copyright 2001-2023, Python Software Foundation.</div>
</body></html>"""


def test_main_content_only_with_code_kept_verbatim():
    text = html_to_text(SPHINX_PAGE)
    assert text == (
        "Built-in Functions\n\n"
        "The Python interpreter has a number of functions & types.\n"
        "Second line.\n\n"
        "def f(x):\n"
        "    return  x   +  1\n\n"
        "one\n\n"
        "two\n\n"
        "a b\n\n"
        "After <image> café"
    )


def test_page_without_main_gives_its_body_without_scripts():
    page = "<html><head><title>T</title></head><body><h2>Head</h2><script>x()</script><p>Body text.</p></body></html>"
    assert html_to_text(page) == "Head\n\nBody text."


def test_malformed_html_does_not_raise():
    assert html_to_text("<div role='main'><p>unclosed <b>bold") == "unclosed bold"
    assert html_to_text("") == ""


def test_clean_text_normalises_newlines_and_trailing_space_only():
    raw = "\n\n  indented line  \r\nnext\tline\t\r\n\n\n\n\n\nlast\n\n"
    assert clean_text(raw) == "  indented line\nnext\tline\n\n\nlast"


def test_near_key_ignores_case_punctuation_and_wrapping_but_not_words():
    a = "The quick brown fox,\njumps over the lazy dog."
    b = "the QUICK   brown fox jumps\tover the lazy dog!!"
    c = "The quick brown fox jumps over the lazy cat."
    assert normalize_for_dedup(a) == "the quick brown fox jumps over the lazy dog"
    assert near_key(a) == near_key(b) != near_key(c)
    assert exact_key(a) != exact_key(b)
    assert exact_key(a) == hashlib.sha256(a.encode()).hexdigest()
    assert exact_key(a + "\n\n") == exact_key(a)  # trailing blank lines are not content

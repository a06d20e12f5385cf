#!/usr/bin/env python3
"""Checks the links between the project's Markdown pages: README.md and
docs/*.md. Every relative link must name a file or directory that exists,
and every #anchor must be a heading of the page it points into (GitHub's
anchors: lowercased, punctuation dropped, spaces as hyphens, -1, -2, ... for
repeats) or an <a id="..."> in it. Links to the web are not followed. Prints one line per broken
link, then "links: N passed, N failed, 0 skipped"; exits 1 on any failure.

Usage: scripts/check-links.py [--fix-anchors]  (run from anywhere)
  --fix-anchors rewrites a bare #anchor that is not on its own page into a
  link to the page that has it (for moving text between pages).
"""
import os
import re
import sys
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r'(?<!!)\[([^\]]*)\]\(([^)\s]+)\)')
IMAGE = re.compile(r'!\[([^\]]*)\]\(([^)\s]+)\)')


def pages():
    out = [os.path.join(ROOT, 'README.md')]
    docs = os.path.join(ROOT, 'docs')
    out += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith('.md'))
    return out


def prose(text):
    """The page without its fenced code blocks (links there are code)."""
    out, fence = [], False
    for line in text.split('\n'):
        if line.lstrip().startswith('```'):
            fence = not fence
            out.append('')
            continue
        out.append('' if fence else line)
    return out


def slug(heading):
    h = re.sub(r'<[^>]+>', '', heading).strip().lower()
    h = ''.join(c for c in h if c.isalnum() or c in ' -_')
    return h.replace(' ', '-')


def anchors(path):
    seen, out = {}, set()
    for line in prose(open(path, encoding='utf-8').read()):
        out.update(re.findall(r'<a id="([^"]+)"', line))
        m = re.match(r'^(#{1,6}) +(.*?) *#*$', line)
        if not m:
            continue
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f'{s}-{n}')
    return out


def main():
    fix = '--fix-anchors' in sys.argv
    all_pages = pages()
    heads = {p: anchors(p) for p in all_pages}
    passed = failed = 0
    for page in all_pages:
        text = open(page, encoding='utf-8').read()
        lines = prose(text)
        rel = os.path.relpath(page, ROOT)
        for no, line in enumerate(lines, 1):
            for m in list(LINK.finditer(line)) + list(IMAGE.finditer(line)):
                target = m.group(2)
                if re.match(r'^[a-z][a-z0-9+.-]*:', target):
                    continue
                path, _, frag = target.partition('#')
                dest = os.path.normpath(os.path.join(os.path.dirname(page), urllib.parse.unquote(path))) if path else page
                problem = None
                if not os.path.exists(dest):
                    problem = f'{path} does not exist'
                elif frag and dest.endswith('.md') and frag not in heads.get(dest, anchors(dest)):
                    problem = f'{os.path.relpath(dest, ROOT)} has no heading #{frag}'
                    if fix and not path:
                        home = [p for p in all_pages if frag in heads[p]]
                        if len(home) == 1:
                            new = os.path.relpath(home[0], os.path.dirname(page)) + '#' + frag
                            text = text.replace(f']({target})', f']({new})')
                            problem = None
                if problem:
                    print(f'FAIL: {rel}:{no}: [{m.group(1)}]({target}): {problem}')
                    failed += 1
                else:
                    passed += 1
        if fix:
            open(page, 'w', encoding='utf-8').write(text)
    print(f'links: {passed} passed, {failed} failed, 0 skipped')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())

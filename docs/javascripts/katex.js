// Render $...$ and $$...$$ (emitted by pymdownx.arithmatex in generic mode) with KaTeX,
// also after Material's instant navigation swaps the page body.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
});

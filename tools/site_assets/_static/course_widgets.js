// Loaded after require.js and before the ipywidgets embedder (html-manager/embed-amd.js).
// Each module the embedder defines (@jupyter-widgets/base, /controls, /html-manager/dist/...)
// takes its webpack public path, where its fonts are fetched from, from its own AMD module URL.
// Map those ids to the copy under _static/html-manager/, where the fonts are.
(function () {
  var here = document.currentScript.src.replace(/[^/]*$/, "") + "html-manager";
  require.config({paths: {"@jupyter-widgets": here, "@jupyter-widgets/html-manager/dist": here}});
}());

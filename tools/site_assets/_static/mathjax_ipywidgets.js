// Runs after Sphinx's inline `window.MathJax = {...}` config and before MathJax 3 itself (deferred).
// ipywidgets typesets labels with the MathJax 2 call Hub.Queue(["Typeset", Hub, el]); the site
// serves MathJax 3, so that call is answered with typesetPromise([el]). No-op on pages without math.
(function () {
  if (!window.MathJax) { return; }
  function queue(cmd) {
    var mj = window.MathJax, el = cmd && cmd[2];
    if (mj && mj.startup && mj.startup.promise && mj.typesetPromise) {
      mj.startup.promise.then(function () { return mj.typesetPromise(el ? [el] : undefined); });
    }
  }
  var startup = window.MathJax.startup = window.MathJax.startup || {};
  startup.ready = function () { window.MathJax.startup.defaultReady(); window.MathJax.Hub = {Queue: queue}; };
  window.MathJax.Hub = {Queue: queue};
}());

(function () {
  var stale = document.getElementById('stale');
  function tick() {
    fetch('/fragment', {cache: 'no-store'}).then(function (r) {
      if (!r.ok) { throw new Error('HTTP ' + r.status); }
      return r.text();
    }).then(function (text) {
      document.getElementById('content').innerHTML = text;
      stale.className = '';
    }).catch(function () { stale.className = 'on'; });
  }
  setInterval(tick, ${refresh_ms});
})();

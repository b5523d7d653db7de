import Foundation
import Glibc
import StorefsCore

/// SIGHUP and SIGUSR1, taken by one thread with `sigwait` (docs/operations.md, "Signals"):
/// SIGHUP reopens `log_file=` (logrotate) and no longer unmounts; SIGUSR1 logs a one-line
/// summary of the stats. SIGTERM and SIGINT still end the mount (libfuse's handlers).
enum SignalThread {
    /// Blocks the two signals in the calling thread, which every thread started after it
    /// inherits; call before the first worker starts, after daemonizing.
    static func start(summary: @escaping @Sendable () -> [(String, String)]) {
        var set = sigset_t()
        sigemptyset(&set)
        sigaddset(&set, SIGHUP)
        sigaddset(&set, SIGUSR1)
        // libfuse's SIGHUP handler would end the loop: back to the default, then blocked, so
        // only `sigwait` below ever sees it.
        signal(SIGHUP, SIG_DFL)
        pthread_sigmask(SIG_BLOCK, &set, nil)
        let waited = set
        let thread = Thread {
            var set = waited
            while true {
                var sig: Int32 = 0
                guard sigwait(&set, &sig) == 0 else { continue }
                switch sig {
                case SIGHUP: Log.reopen()
                case SIGUSR1: Log.log(.info, "stats", fields: summary())
                default: break
                }
            }
        }
        thread.name = "storefs-signals"
        thread.start()
    }
}

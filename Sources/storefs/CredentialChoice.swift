import Foundation
import Glibc
import StorageClient
import StorefsCore

/// Picks the credentials a mount uses, in this order (README, "Which credentials a mount uses"):
/// `anonymous` → `token_file=` → `api_key=` (Firebase user) → `credentials=` /
/// GOOGLE_APPLICATION_CREDENTIALS / gcloud's application-default file → the metadata server
/// (GCE_METADATA_HOST, or metadata.google.internal when it answers) → none.
struct CredentialChoice {
    var credentials: Credentials
    /// A service-account key, for V4 signed download URLs.
    var signer: URLSigner?
    var summary: String

    /// Warns (once, at mount, on stderr) about a secret file other users may read: it is
    /// accepted, but whoever can read it can act as this mount.
    static func warnIfReadableByOthers(_ path: String, what: String) {
        var st = stat()
        guard stat(path, &st) == 0, st.st_mode & 0o077 != 0 else { return }
        Log.warn("\(what) \(path) is readable by other users (mode \(String(st.st_mode & 0o777, radix: 8))): run chmod 600 \(path)")
    }

    static func resolve(_ o: MountOptions, environment env: [String: String], http: HTTPClient) throws(StorageError) -> CredentialChoice {
        let services = TokenServices(authEndpoint: o.authEndpoint, http: http)
        let firebase = o.storageProtocol == .firebase
        if o.anonymous { return CredentialChoice(credentials: AnonymousCredentials(), summary: "anonymous") }
        if let file = o.tokenFile {
            warnIfReadableByOthers(file, what: "token_file")
            let scheme = firebase ? "Firebase" : "Bearer"
            return CredentialChoice(credentials: try TokenFileCredentials(path: file, scheme: scheme), summary: "token_file")
        }
        if let apiKey = o.apiKey {
            var signIn = FirebaseUserCredentials.SignIn.anonymous
            if let email = o.email, let passwordFile = o.passwordFile {
                warnIfReadableByOthers(passwordFile, what: "password_file")
                guard let data = FileManager.default.contents(atPath: passwordFile) else {
                    throw StorageError(.invalidArgument, "password_file \(passwordFile) cannot be read")
                }
                var password = String(decoding: data, as: UTF8.self)
                while password.hasSuffix("\n") || password.hasSuffix("\r") { password.removeLast() }
                signIn = .password(email: email, password: password)
            }
            let c = FirebaseUserCredentials.make(apiKey: apiKey, signIn: signIn, services: services)
            return CredentialChoice(credentials: c, summary: c.label)
        }
        var path = o.credentialsFile ?? env["GOOGLE_APPLICATION_CREDENTIALS"].flatMap { $0.isEmpty ? nil : $0 }
        if path == nil {
            let config = env["CLOUDSDK_CONFIG"] ?? ((env["HOME"] ?? "/root") + "/.config/gcloud")
            let adc = config + "/application_default_credentials.json"
            if FileManager.default.fileExists(atPath: adc) { path = adc }
        }
        if let path {
            warnIfReadableByOthers(path, what: "credentials file")
            let file = try GoogleCredentials.load(path: path)
            let c = GoogleCredentials.make(file, services: services)
            var signer: URLSigner? = nil
            if case .serviceAccount(let key) = file { signer = URLSigner(key: key, expiry: o.urlExpiry) }
            return CredentialChoice(credentials: c, signer: signer, summary: c.label)
        }
        if let host = env["GCE_METADATA_HOST"] ?? env["GCE_METADATA_ROOT"], !host.isEmpty {
            let c = GoogleCredentials.metadataServer(host: host, services: services)
            return CredentialChoice(credentials: c, summary: c.label)
        }
        // An emulator on this machine needs nothing; otherwise try the metadata server, which
        // exists only on Google Cloud (off it, its name does not even resolve).
        if URLOrigin(o.resolvedEndpoint)?.isLoopback != true, metadataServerAnswers(http) {
            let c = GoogleCredentials.metadataServer(host: "metadata.google.internal", services: services)
            return CredentialChoice(credentials: c, summary: c.label)
        }
        return CredentialChoice(credentials: AnonymousCredentials(), summary: "none found (anonymous)")
    }

    private static func metadataServerAnswers(_ http: HTTPClient) -> Bool {
        guard let r = try? http.get("http://metadata.google.internal/computeMetadata/v1/", headers: ["Metadata-Flavor: Google"],
                                    limit: 1 << 16) else { return false }
        return r.headers["metadata-flavor"] == "Google"
    }
}

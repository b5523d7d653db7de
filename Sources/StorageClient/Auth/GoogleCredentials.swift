import Foundation
import Locking

/// Google OAuth2 credentials for the GCS JSON API (and admin access to v0), docs/protocol.md §5.7.
public enum GoogleCredentials {
    public static let readOnlyScope = "https://www.googleapis.com/auth/devstorage.read_only"

    /// A service-account key: what the JWT grant and V4 URL signing need.
    public struct ServiceAccountKey: Sendable {
        public var clientEmail: String
        public var privateKey: String
        public var privateKeyID: String?
        public var tokenURI: String
    }

    /// Parsed credential file (`credentials=`, GOOGLE_APPLICATION_CREDENTIALS or the gcloud ADC file).
    public enum File: Sendable {
        case serviceAccount(ServiceAccountKey)
        case authorizedUser(clientID: String, clientSecret: String, refreshToken: String)
    }

    public static func load(path: String) throws(StorageError) -> File {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw StorageError(.invalidArgument, "credentials file \(path) cannot be read")
        }
        guard let json = (try? JSONSerialization.jsonObject(with: data)) as? [String: Any] else {
            throw StorageError(.invalidArgument, "credentials file \(path) is not JSON")
        }
        switch json["type"] as? String {
        case "service_account":
            guard let email = json["client_email"] as? String, let key = json["private_key"] as? String else {
                throw StorageError(.invalidArgument, "credentials file \(path): a service_account key needs client_email and private_key")
            }
            return .serviceAccount(ServiceAccountKey(
                clientEmail: email, privateKey: key, privateKeyID: json["private_key_id"] as? String,
                tokenURI: (json["token_uri"] as? String) ?? "https://oauth2.googleapis.com/token"))
        case "authorized_user":
            guard let id = json["client_id"] as? String, let secret = json["client_secret"] as? String,
                  let refresh = json["refresh_token"] as? String else {
                throw StorageError(.invalidArgument, "credentials file \(path): authorized_user needs client_id, client_secret and refresh_token")
            }
            return .authorizedUser(clientID: id, clientSecret: secret, refreshToken: refresh)
        case let other:
            throw StorageError(.invalidArgument, "credentials file \(path) has type '\(other ?? "none")': storefs reads service_account and authorized_user files")
        }
    }

    /// The RS256-signed JWT of the service-account grant.
    static func assertion(_ key: ServiceAccountKey, audience: String, now: Double) throws(StorageError) -> String {
        var header: [String: Any] = ["alg": "RS256", "typ": "JWT"]
        if let kid = key.privateKeyID { header["kid"] = kid }
        let iat = Int(now)
        let claims: [String: Any] = ["iss": key.clientEmail, "scope": readOnlyScope, "aud": audience, "iat": iat, "exp": iat + 3600]
        func part(_ obj: [String: Any]) -> String {
            Crypto.base64url(Array((try? JSONSerialization.data(withJSONObject: obj, options: [.sortedKeys])) ?? Data()))
        }
        let signingInput = part(header) + "." + part(claims)
        let signature = try Crypto.rs256Sign(pem: key.privateKey, Array(signingInput.utf8))
        return signingInput + "." + Crypto.base64url(signature)
    }

    public static func make(_ file: File, services: TokenServices) -> RefreshingCredentials {
        switch file {
        case .serviceAccount(let key):
            let url = services.authEndpoint == nil ? key.tokenURI : services.oauthTokenURL
            return RefreshingCredentials(scheme: "Bearer", label: "service account \(key.clientEmail)") { _ throws(StorageError) in
                // The audience is Google's token endpoint whatever URL the grant is posted to.
                let jwt = try assertion(key, audience: "https://oauth2.googleapis.com/token", now: wallClock())
                let answer = try services.post(url, form: [("grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer"),
                                                           ("assertion", jwt)], what: "service-account token grant")
                return AccessToken(value: try TokenServices.token(answer, key: "access_token", what: "token grant"),
                                   expiresAt: TokenServices.expiry(answer, key: "expires_in"))
            }
        case .authorizedUser(let id, let secret, let refresh):
            return RefreshingCredentials(scheme: "Bearer", label: "authorized user \(id.prefix(12))…") { _ throws(StorageError) in
                let answer = try services.post(services.oauthTokenURL,
                                               form: [("grant_type", "refresh_token"), ("client_id", id),
                                                      ("client_secret", secret), ("refresh_token", refresh)],
                                               what: "authorized-user token refresh")
                return AccessToken(value: try TokenServices.token(answer, key: "access_token", what: "token refresh"),
                                   expiresAt: TokenServices.expiry(answer, key: "expires_in"))
            }
        }
    }

    /// The GCE / Cloud Run metadata server at `host` (GCE_METADATA_HOST, e.g. `169.254.169.254`).
    public static func metadataServer(host: String, services: TokenServices) -> RefreshingCredentials {
        let base = host.contains("://") ? host : "http://" + host
        let url = "\(base)/computeMetadata/v1/instance/service-accounts/default/token?scopes=\(ObjectName.encode(readOnlyScope))"
        return RefreshingCredentials(scheme: "Bearer", label: "metadata server") { _ throws(StorageError) in
            let answer = try services.get(url, headers: ["Metadata-Flavor: Google"], what: "metadata server token")
            return AccessToken(value: try TokenServices.token(answer, key: "access_token", what: "metadata server"),
                               expiresAt: TokenServices.expiry(answer, key: "expires_in"))
        }
    }
}

/// A Firebase Auth user: signed in with email and password, or anonymously, through the
/// Identity Toolkit; the ID token is renewed through the secure-token service (docs/protocol.md §3.2).
public enum FirebaseUserCredentials {
    public enum SignIn: Sendable {
        case password(email: String, password: String)
        case anonymous
    }

    public static func make(apiKey: String, signIn: SignIn, services: TokenServices) -> RefreshingCredentials {
        let key = ObjectName.encode(apiKey)
        let label: String
        switch signIn {
        case .password(let email, _): label = "firebase user \(email)"
        case .anonymous: label = "firebase anonymous user"
        }
        let refreshToken = RefreshTokenBox()
        return RefreshingCredentials(scheme: "Firebase", label: label) { previous throws(StorageError) in
            if previous != nil, let rt = refreshToken.value {
                let answer = try services.post(
                    services.url(host: "securetoken.googleapis.com", path: "/v1/token?key=\(key)"),
                    form: [("grant_type", "refresh_token"), ("refresh_token", rt)], what: "Firebase ID token refresh")
                if let rotated = answer["refresh_token"] as? String { refreshToken.value = rotated }
                return AccessToken(value: try TokenServices.token(answer, key: "id_token", what: "token refresh"),
                                   expiresAt: TokenServices.expiry(answer, key: "expires_in"))
            }
            let answer: [String: Any]
            switch signIn {
            case .password(let email, let password):
                answer = try services.post(
                    services.url(host: "identitytoolkit.googleapis.com", path: "/v1/accounts:signInWithPassword?key=\(key)"),
                    json: ["email": email, "password": password, "returnSecureToken": true], what: "Firebase sign-in of \(email)")
            case .anonymous:
                answer = try services.post(
                    services.url(host: "identitytoolkit.googleapis.com", path: "/v1/accounts:signUp?key=\(key)"),
                    json: ["returnSecureToken": true], what: "Firebase anonymous sign-in")
            }
            refreshToken.value = answer["refreshToken"] as? String
            return AccessToken(value: try TokenServices.token(answer, key: "idToken", what: "sign-in"),
                               expiresAt: TokenServices.expiry(answer, key: "expiresIn"))
        }
    }

    /// The latest refresh token (it may rotate on every refresh).
    final class RefreshTokenBox: @unchecked Sendable {
        private let lock = OrderedLock(.refreshToken)
        private var stored: String?
        var value: String? {
            get { lock.lock(); defer { lock.unlock() }; return stored }
            set { lock.lock(); stored = newValue; lock.unlock() }
        }
    }
}
